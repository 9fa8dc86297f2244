"""bench/chaos.py under SLURM (``--launcher slurm``): the run is launch/slurm/train.sbatch, the script a user submits,
on the two-node cluster of the tests (tests/slurm_two_nodes.py: two slurmd in two network namespaces joined by a veth
link, one rank per node, the rendezvous and gloo across the link), and the restarts are SLURM's own.

After a transient fault or a stop the batch script requeues its job (launch/slurm/common.sh; GRPO_MAX_FAULT_REQUEUES
is raised so that a schedule's faults never use the cap up), and the requeued job resumes; after a cause a restart
would repeat (a full disk, the PRM scorer's error) the script ends the job, and this supervisor submits it again, as
a user does once the disk is freed or the scorer fixed. The faults go in the way a cluster's do:

  sigkill / sigstop  to one rank's process (found by its environment, on whichever node it runs)
  store_lost         every process of the job's step on the first node (its torchrun hosts the rendezvous and the
                     c10d store), as a node crash takes them (tests/test_slurm_two_nodes.py's node loss)
  sigterm            ``scancel --signal=TERM JOB``: the step's processes, as a preemption does
  usr1               ``scancel --signal=USR1 --batch JOB``: the batch shell's warning before the time limit
                     (``--signal=B:USR1@300``), which it turns into a SIGTERM to the step; the stop line says SIGTERM
  planted kinds      bench/fault_inject.py as the ranks' module (``GRPO_MEGA_ENTRY=bench.fault_inject``), the fault
                     named in a file (``GRPO_FAULT_FILE``) this supervisor rewrites before each attempt: a requeued
                     job restarts with the environment it was submitted with
  altered            a rank SIGKILLed, and the checkpoint altered while the requeued job is held (``scontrol hold``,
                     then ``release``): the restart must refuse it by its checksum and fall back
  disk_full          the run folder's tmpfs filled, as under the local launcher; bench/chaos.py mounts it before the
                     cluster starts (each node's mount namespace is a copy made when its slurmd starts)

Each attempt's part of the job log (from the script's ``SLURM_RESTART_COUNT=`` banner) is written to the schedule's
logs/attemptNN.log, which bench/chaos.py reads as it reads the local launcher's. Needs root (namespaces, slurmd) and
slurm-wlm / munge (installed with apt when missing); nothing else may use the two-node cluster meanwhile (the test
suite's tests/test_slurm_two_nodes.py does).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from chaos_faults import (PLANTED, AttemptStart, DiskFill, Fault, alter_newest, attempt_start, inject, planted_env,
                          poll_attempt, rank_pid, record_attempt, step_reached, trigger_now)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TRAIN_SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
PROGRAM = b"bench.fault_inject"
"""The ranks' module (GRPO_MEGA_ENTRY): on the torchrun launcher's command line, which rank_pid reads."""
STOPS = {"sigterm": "SIGTERM", "usr1": "SIGTERM"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}
MAX_FAULT_REQUEUES = 1000


@contextlib.contextmanager
def two_node_cluster():
    """The tests' two-node cluster, up for the ``with`` block and stopped after it; SystemExit where it cannot run."""
    import pytest
    from slurm_two_nodes import two_node_cluster as cluster_fixture

    started = cluster_fixture()
    try:
        cluster = next(started)
    except pytest.skip.Exception as why:
        raise SystemExit(f"--launcher slurm: the two-node SLURM cluster cannot run here: {why}") from None
    try:
        yield cluster
    finally:
        started.close()


class SlurmSupervisor:
    """Runs the schedule's attempts as one SLURM job and its requeues (a new job where the script ends one)."""

    def __init__(self, cluster, overrides: list[str], config: Path, run_dir: Path, logs: Path, env: dict,
                 timeout: int, disk: Path | None, rollout_lead: int = 0, rollout_rank: int = 1):
        self.cluster, self.overrides, self.run_dir, self.logs, self.disk = cluster, overrides, run_dir, logs, disk
        self.rollout_lead, self.rollout_rank = rollout_lead, rollout_rank
        self.fault_file = logs / "fault.json"
        self.env = dict(env, SLURM_CONF=str(cluster.conf), CONFIG=str(config), NPROC_PER_NODE="1",
                        PYTHON=sys.executable, PYTHONPATH=str(ROOT), GRPO_MEGA_ENTRY=PROGRAM.decode(),
                        GRPO_FAULT_FILE=str(self.fault_file), GRPO_MAX_FAULT_REQUEUES=str(MAX_FAULT_REQUEUES))
        self.env["PATH"] = f"{Path(sys.executable).parent}:{self.env.get('PATH', '')}"
        self.limit = 2 * timeout + 30 + 60  # the local launcher's limit with SLURM's KillWait (30 s) for the grace
        self.stops = STOPS
        self.attempts = 0
        self.first_step_at: list[float] = []
        self.jobs: list[str] = []
        self.job: str | None = None
        """The job the next attempt runs in (requeued), or None: the next attempt submits one."""
        self.restart = 0
        """SLURM_RESTART_COUNT of the current attempt's run of ``self.job``."""
        self._state: tuple[float, str, str | None] = (0.0, "", None)
        self._exited_at: float | None = None
        """When the current attempt's step had exited with every rank gone (first seen)."""

    # --- the job -------------------------------------------------------------------------------------------------
    def _submit(self) -> str:
        result = subprocess.run(
            self.cluster.command("sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0",
                                 f"--cpus-per-task={os.cpu_count()}", f"--output={self.logs}/%x-%j.out",
                                 str(TRAIN_SBATCH), *self.overrides),
            capture_output=True, text=True, timeout=60, env=self.env, cwd=ROOT)
        if result.returncode != 0:
            raise SystemExit(f"sbatch failed: {result.stderr.strip()}")
        job = result.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def state(self, job: str, fresh: bool = False) -> str | None:
        """The job's JobState, asked of slurmctld at most every 0.5 s unless ``fresh`` (every poll of this
        supervisor asks, and each question is a process in the node's namespace)."""
        asked, of, state = self._state
        if fresh or of != job or time.monotonic() - asked > 0.5:
            out = self.cluster.run("scontrol", "-o", "show", "job", job).stdout
            found = re.search(r"\bJobState=(\S+)", out)
            state = found.group(1) if found else None
            self._state = (time.monotonic(), job, state)
        return state

    def part(self, job: str, restart: int) -> str:
        path = self.logs / f"grpo-mega-{job}.out"
        return log_part(path.read_text(errors="replace") if path.exists() else "", job, restart)

    def _outcome(self) -> tuple[int | None, str | None]:
        """(the step's exit status, what came of the job) once the current run's step has exited and the batch
        script decided: "requeued", or the job's terminal state; (status, None) while it is deciding."""
        part = self.part(self.job, self.restart)
        exited = re.search(r"step train exited with status (\d+)", part)
        status = int(exited.group(1)) if exited else None
        if "; requeueing" in part:
            return status, "requeued"
        state = self.state(self.job) if exited or not part else None
        return status, state if state in TERMINAL else None

    def _ranks_alive(self) -> list[int]:
        return [p for p in (rank_pid(r, self.run_dir, PROGRAM) for r in range(2)) if p]

    # --- one attempt -----------------------------------------------------------------------------------------------
    def _begin(self, spec: str | None) -> None:
        """Name this attempt's planted fault (or none) and make sure a job will run it."""
        self.attempts += 1
        mark = self.logs / f"attempt{self.attempts:02d}.fault_at"
        self.fault_file.write_text(json.dumps({"fault": spec, "mark": str(mark)}) + "\n")
        self._exited_at = None
        if self.job is None:
            self.job, self.restart = self._submit(), 0
        else:
            self.restart += 1

    def _wait(self, start: AttemptStart, until) -> bool:
        """Poll until ``until()`` or the step's exit; notes the attempt's first logged row. True when ``until()``."""
        reached, first_row = poll_attempt(self.run_dir, start, until, self._step_over)
        self.first_step_at.append(first_row)
        return reached

    def _step_over(self) -> bool:
        """Whether the attempt's step has exited with every rank gone, or the job has ended (noting when)."""
        status, outcome = self._outcome()
        if outcome is not None or (status is not None and not self._ranks_alive()):
            self._exited_at = self._exited_at or time.time()
            return True
        return False

    def _end(self) -> tuple[float, bool, int | None]:
        """Wait for the step to exit with every rank gone (kill what outlives the limit), then for the script's
        decision; returns when the last rank went, whether anything had to be killed, and the step's status."""
        deadline, hung, ended, job = time.monotonic() + self.limit, False, self._exited_at, self.job
        while True:
            status, outcome = self._outcome()
            alive = self._ranks_alive()
            if ended is None and status is not None and not alive:
                ended = time.time()
            if outcome is not None and not alive:
                break
            if time.monotonic() > deadline:
                hung = True
                for pid in alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if time.monotonic() > deadline + 120:
                    self.cluster.run("scancel", self.job)
                    raise SystemExit(f"job {self.job} did not end {self.limit + 120} s after its fault: see "
                                     f"{self.logs}/grpo-mega-{self.job}.out")
            time.sleep(0.05 if ended is None else 0.25)
        if outcome != "requeued":
            self.job = None  # ended without a requeue: the next attempt submits the job again
        (self.logs / f"attempt{self.attempts:02d}.log").write_text(self.part(job, self.restart))
        return ended or time.time(), hung, status

    def _inject(self, fault: Fault, job: str, disk_fill: DiskFill | None) -> float | None:
        if fault.kind == "sigterm":
            self.cluster.run("scancel", "--signal=TERM", job)
            return time.time()
        if fault.kind == "usr1":
            self.cluster.run("scancel", "--signal=USR1", "--batch", job)
            return time.time()
        if fault.kind == "store_lost":
            from slurm_two_nodes import NODES, job_processes_on

            victims = job_processes_on(job, NODES[0])
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return time.time() if victims else None
        return inject(fault, -1, self.run_dir, disk_fill, PROGRAM)

    def attempt(self, fault: Fault, rng: random.Random) -> None:
        # Read before a requeued job runs: it is pending until its credential expires (the tests' cluster: 10 s)
        at = attempt_start(self.run_dir)
        trigger = trigger_now(fault, at.resume_step, self.rollout_lead, self.rollout_rank)
        self._begin(planted_env(fault, trigger).get("GRPO_FAULT"))
        job, mark = self.job, self.logs / f"attempt{self.attempts:02d}.fault_at"
        disk_fill = None
        if fault.kind in PLANTED:
            self._wait(at, lambda: False)
            ended, hung, status = self._end()
            fault_at = float(mark.read_text()) if mark.exists() else None
        else:
            reached = self._wait(at, lambda: step_reached(self.run_dir, at) >= trigger)
            fault_at = None
            disk_fill = DiskFill(self.disk) if self.disk is not None and fault.kind == "disk_full" else None
            if reached:
                time.sleep(fault.delay_s)
                part = self.part(job, self.restart)
                if part and "exited with status" not in part:
                    fault_at = self._inject(fault, job, disk_fill)
            ended, hung, status = self._end()
            if disk_fill is not None:
                disk_fill.release_after(fault.record, self.run_dir)
        held = fault.kind == "altered" and fault_at is not None and self._hold()
        try:
            record_attempt(fault, self.run_dir, (self.logs / f"attempt{self.attempts:02d}.log").read_text(),
                           self.attempts, trigger, status, hung, fault_at, ended)
            fault.record.update(job=job, restart_count=self.restart)
            if fault.kind == "altered" and fault_at is not None:
                fault.record.update(alter_newest(self.run_dir, rng), held_requeued_job=held)
        finally:
            if held:
                self.cluster.run("scontrol", "release", self.job)

    def _hold(self) -> bool:
        """Hold the requeued job (pending until its credential expires) so that nothing loads the checkpoint while
        it is altered; False when there is no requeued job to hold."""
        if self.job is None:
            return False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.state(self.job, fresh=True) == "PENDING":
                return self.cluster.run("scontrol", "hold", self.job).returncode == 0
            time.sleep(0.1)
        return False

    def run_to_end(self) -> list[int]:
        """The attempts after the last fault until the job completes (at most 3 runs): their step statuses."""
        finals = []
        for _ in range(3):
            at = attempt_start(self.run_dir)
            self._begin(None)
            self._wait(at, lambda: False)
            _, _, status = self._end()
            finals.append(status)
            if status == 0:
                break
        if self.job is not None:
            self.cluster.run("scancel", self.job)
        return finals


def log_part(text: str, job: str, restart: int) -> str:
    """The part of job ``job``'s log (``text``, appended to by every run: ``--open-mode=append``) that its run number
    ``restart`` wrote: from that run's banner (launch/slurm/common.sh's ``SLURM_RESTART_COUNT=``) to the next."""
    for piece in re.split(rf"(?m)^(?==== grpo-mega job {job} \S* ?SLURM_RESTART_COUNT=)", text):
        if re.match(rf"=== grpo-mega job {job} \S* ?SLURM_RESTART_COUNT={restart} ", piece):
            return piece
    return ""


def reference(cluster, overrides: list[str], config: Path, run_dir: Path, env: dict, timeout: int) -> float:
    """The uninterrupted run under SLURM: one job, no fault; its seconds (SystemExit when it did not complete)."""
    logs = run_dir.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    supervisor = SlurmSupervisor(cluster, overrides, config, run_dir, logs, env, timeout, None)
    start = time.monotonic()
    codes = supervisor.run_to_end()
    if codes[-1:] != [0] or supervisor.restart != 0 or len(supervisor.jobs) != 1:
        raise SystemExit(f"the uninterrupted SLURM run did not complete in one go (statuses {codes}): see {logs}")
    return time.monotonic() - start
