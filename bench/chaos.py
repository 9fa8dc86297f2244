"""One long GRPO run under many faults (issue 61): does it end bit-equal to an uninterrupted run of the same command?

    .venv/bin/python bench/chaos.py [--seed 0] [--faults 20] [--steps 150] [--variant prm|async] [--kinds K,...] \\
        [--launcher local|slurm] [--ranks interpreters|forked] [--timeout 15] [--save-every 3] [--disk-mib 256] [--reuse] [--work DIR] \\
        [--out bench/results/chaos.json]

The run: ``grpo-mega train`` under torchrun (2 gloo ranks) through bench/fault_inject.py, the tiny synthetic task of
bench/fault_setup.py with process supervision by a learned PRM (trained first, once); ``--variant async`` generates on
the second rank (``rollout.mode=async``) and trains on the first. A checkpoint every ``--save-every`` steps
(``trainer.keep_last=2``, the default: an altered newest checkpoint leaves one to fall back to), every prompt dumped
(``trainer.dump_rollouts``). A seeded schedule of ``--faults`` faults (bench/chaos_faults.py: kinds, triggers,
ranks) is met one per attempt: the supervisor here starts the command, injects the fault at its trigger, waits for
the job to end (every rank process gone), alters a checkpoint when the fault says so, and starts the same command
again (the launcher's restart: ``trainer.resume=auto``), to the end. ``--launcher slurm`` runs the same command as
launch/slurm/train.sbatch on the tests' two-node SLURM cluster (one rank per node), restarted by the script's own
requeue (bench/chaos_slurm.py says how each fault goes in there).

At the end (bench/chaos_checks.py), against ONE uninterrupted run of the same command: the final checkpoint's tensors
bit-equal (policy, optimizer, RNG, companions), every metrics row equal (timings and memory aside), 0 prompts lost or
repeated, every fault's cause named (failure.json, kept in the run's failure.json history; a preemption's stop line;
an altered checkpoint refused by its checksum with the fallback said), and per fault the seconds from the fault to
the job's exit and from the exit to the first step the restarted job logs. Results: ``--out`` (one record per
schedule: variant, launcher, seed, faults, steps); ``--reuse`` keeps a finished schedule's record and does not rerun it.

``disk_full`` needs the run on a file system of its own: the run folder is a tmpfs (``--disk-mib``), mounted here
(root); without root the kind is left out of the schedule, and the record says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import chaos_slurm  # noqa: E402
from chaos_checks import compare_runs  # noqa: E402
from chaos_faults import (KINDS, PLANTED, PROGRAM, STOPS, AttemptStart, DiskFill, Fault,  # noqa: E402
                          alter_newest, attempt_start, cause_named, draw_schedule, failure_history, inject,
                          planted_env, poll_attempt, rank_pid, record_attempt, step_reached, trigger_now)
from fault_setup import GRPO_CONFIG, build_fault_task  # noqa: E402

from grpo_mega.run.shared_fork_server import offered_server_pid, without_offer  # noqa: E402

GRACE_S = 10
RUN = ["algorithm.rollout_batch_size=4", "algorithm.num_return_sequences_in_group=2", "algorithm.response_length=12",
       "algorithm.dynamic_sampling=false", "trainer.dump_rollouts=true", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "parallel.device=cpu", "trainer.eval_every=0", "trainer.keep_last=2",
       "algorithm.supervision=process", "process_reward.source=prm"]
VARIANTS = {"prm": ["parallel.tensor=2"],
            "async": ["parallel.tensor=1", "rollout.mode=async", "rollout.async_ranks=1", "algorithm.rollout_is=tis"]}
ROLLOUT_RANK = 1
"""The async variant's rollout rank (``rollout.async_ranks=1``: the last of 2)."""
PLANTED_RANKS = {"async": {"resume_kill": 0, "save_kill": 0, "prm_exception": ROLLOUT_RANK}}
"""Where a planted fault can fire in a variant whose ranks have roles (rank 0 trains, loads and saves the run's
checkpoints; rank 1 generates and scores with the PRM): drawn on the other rank it would never fire, and the attempt
would run to the end with every later fault of the schedule unmet (async seed 0's fault 2, 2026-12-02)."""
ROLLOUT_LEAD = {"async": 1}
"""Steps the rollout world runs ahead of the trainer's log (rollout.max_staleness): a restart resumes it after the
batches its checkpoint holds, so a fault planted there fires at the trainer's next step + this at the earliest
(async seed 0's PRM fault at step 30, 2026-12-02: the checkpoint of step 29 held step 30's batch, scored already)."""


def overrides(task, run_dir: Path, args) -> list[str]:
    """The run's ``grpo-mega train`` overrides (the same under both launchers)."""
    return [f"model.hf_config={task.model}", f"data.train_file={task.train_file}", f"trainer.run_dir={run_dir}",
            f"trainer.collective_timeout_s={args.timeout}", f"trainer.total_steps={args.steps}",
            f"trainer.save_every={args.save_every}", f"process_reward.prm={task.prm}", *RUN,
            *VARIANTS[args.variant]]


RANK_PROGRAMS = {"interpreters": PROGRAM, "forked": chaos_slurm.PROGRAM}
"""What each ``--ranks`` choice's launcher command line names as the ranks' program (rank_pid finds them by it)."""


def command(task, run_dir: Path, args) -> list[str]:
    """The local launcher's command: 2 ranks on this machine running bench/fault_inject.py. ``--ranks interpreters``
    (the recorded schedules): torch's torchrun, each rank a new interpreter; ``--ranks forked``: the launcher
    ``grpo-mega train --nproc 2`` execs (``grpo_mega.run.torchrun``), its ranks forked from a server that imported
    torch, megatron-core and transformers once per attempt (``grpo_mega.run.forked_ranks``: CPU builds of torch), or
    once in all where this process offers a shared one (``grpo_mega.run.shared_fork_server``: the test suite)."""
    if args.ranks == "forked":
        launcher = ["-m", "grpo_mega.run.torchrun", "--standalone", "--nproc-per-node=2", "-m", "--",
                    RANK_PROGRAMS["forked"].decode()]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(ROOT / "bench" / "fault_inject.py")]
    return [sys.executable, *launcher, "train", "--config", str(GRPO_CONFIG), *overrides(task, run_dir, args)]


class Supervisor:
    """Runs the command attempt after attempt in one run folder, one fault per attempt, and records each."""

    def __init__(self, argv: list[str], run_dir: Path, logs: Path, env: dict, timeout: int, disk: Path | None,
                 rollout_lead: int = 0, program: bytes = PROGRAM, shared_server: int | None = None):
        self.argv, self.run_dir, self.logs, self.env, self.disk = argv, run_dir, logs, env, disk
        self.program = program
        """The ranks' program on the launcher's command line (rank_pid)."""
        self.shared_server = shared_server
        """The pid of the shared fork server the attempts' ranks are forked from (rank_pid); None: their own."""
        self.rollout_lead = rollout_lead
        """ROLLOUT_LEAD of the variant: added to the earliest trigger of a fault planted on the rollout rank."""
        self.limit = 2 * timeout + GRACE_S + 60
        self.stops = STOPS
        """What each preemption kind's stop line names (chaos_faults.cause_named)."""
        self.attempts = 0
        self.first_step_at: list[float] = []  # per attempt: when it logged its first row (nan: none)

    def start(self, extra_env: dict) -> tuple[subprocess.Popen, Path]:
        self.attempts += 1
        log = self.logs / f"attempt{self.attempts:02d}.log"
        mark = self.logs / f"attempt{self.attempts:02d}.fault_at"
        env = dict(self.env, GRPO_FAULT_MARK=str(mark), **extra_env)
        job = subprocess.Popen(self.argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return job, log

    def wait_for(self, job: subprocess.Popen, start: AttemptStart, until) -> bool:
        """Poll until ``until()`` or the job's end; notes the attempt's first logged row. True when ``until()``."""
        reached, first_row = poll_attempt(self.run_dir, start, until, lambda: job.poll() is not None)
        self.first_step_at.append(first_row)
        return reached

    def end(self, job: subprocess.Popen) -> tuple[float, bool]:
        """Wait for the job and every rank process of the run to be gone (kill what outlives the limit); returns the
        time the last one went and whether anything had to be killed."""
        deadline, hung = time.monotonic() + self.limit, False
        try:
            job.wait(timeout=self.limit)
        except subprocess.TimeoutExpired:
            hung = True
            job.kill()
            job.wait()
        while (pids := [p for p in (rank_pid(r, self.run_dir, self.program, self.shared_server) for r in range(2))
                        if p]):
            if time.monotonic() > deadline:
                hung = True
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        return time.time(), hung

    def run_to_end(self) -> list[int]:
        """The restart after the last fault, to the end; again if it failed (recorded): the exit codes."""
        finals = []
        for _ in range(3):
            at = attempt_start(self.run_dir)
            job, _ = self.start({})
            self.wait_for(job, at, lambda: False)
            self.end(job)
            finals.append(job.returncode)
            if job.returncode == 0:
                break
        return finals

    def attempt(self, fault: Fault, rng: random.Random) -> None:
        """One attempt that meets ``fault``; the fault's record says what happened."""
        at = attempt_start(self.run_dir)
        trigger = trigger_now(fault, at.resume_step, self.rollout_lead, ROLLOUT_RANK)
        job, log = self.start(planted_env(fault, trigger))
        mark = log.with_suffix(".fault_at")
        if fault.kind in PLANTED:
            self.wait_for(job, at, lambda: False)
            fault_at = float(mark.read_text()) if mark.exists() else None
            ended, hung = self.end(job)
        else:
            reached = self.wait_for(job, at, lambda: step_reached(self.run_dir, at) >= trigger)
            fault_at = None
            disk_fill = DiskFill(self.disk) if self.disk is not None and fault.kind == "disk_full" else None
            if reached:
                time.sleep(fault.delay_s)
                if job.poll() is None:
                    fault_at = inject(fault, job.pid, self.run_dir, disk_fill, self.program, self.shared_server)
            ended, hung = self.end(job)
            if disk_fill is not None:
                disk_fill.release_after(fault.record, self.run_dir)
        record_attempt(fault, self.run_dir, log.read_text(), self.attempts, trigger, job.returncode, hung, fault_at,
                       ended)
        if fault.kind == "altered" and fault_at is not None:
            fault.record.update(alter_newest(self.run_dir, rng))


def run_schedule(schedule: list[Fault], supervisor, seed: int) -> dict:
    """The faulted run: every fault of ``schedule``, then the command again until it ends (exit 0). ``supervisor``
    (:class:`Supervisor`, or bench/chaos_slurm.py's under SLURM) runs the attempts in its run folder."""
    run_dir, logs = supervisor.run_dir, supervisor.logs
    rng = random.Random(seed + 1000)
    started = time.time()
    for number, fault in enumerate(schedule):
        supervisor.attempt(fault, rng)
        print(f"fault {number + 1}/{len(schedule)} {fault.kind}: " + json.dumps(
            {k: fault.record.get(k) for k in ("trigger_used", "exit_code", "seconds_to_exit", "failure", "missed",
                                              "altered")}, default=str), flush=True)
    finals = supervisor.run_to_end()
    for number, fault in enumerate(schedule):  # restart costs and causes, now that every attempt's log exists
        record = fault.record
        if "exited_at" in record:
            later = [t for t in supervisor.first_step_at[record["attempt"]:] if t == t and t > record["exited_at"]]
            record["seconds_to_next_step"] = round(later[0] - record["exited_at"], 2) if later else None
        log = (logs / f"attempt{record['attempt']:02d}.log").read_text()
        restart = logs / f"attempt{record['attempt'] + 1:02d}.log"
        record["cause_named"], record["named_by"] = cause_named(
            fault, record.get("failure"), log, restart.read_text() if restart.exists() else "", supervisor.stops)
    history = failure_history(run_dir)
    times = {round(r["unix_time"], 3) for r in history if "unix_time" in r}
    for fault in schedule:
        failure = fault.record.get("failure")
        fault.record["in_failure_history"] = None if failure is None else round(failure["unix_time"], 3) in times
    return {"run_dir": str(run_dir), "attempts": supervisor.attempts, "final_exit_codes": finals,
            "seconds": round(time.time() - started, 1), "failure_history": len(history)}


def reference(args, task, work: Path, env: dict, cluster=None) -> Path:
    """The uninterrupted run of the same command under the same launcher (``cluster``: SLURM's), kept in ``work``
    and reused by the schedules that share it."""
    launcher = f"-{args.launcher}" if cluster is not None else "-forked" if args.ranks == "forked" else ""
    run_dir = work / f"reference-{args.variant}{launcher}-{args.steps}-{args.save_every}" / "run"
    done = run_dir.parent / "done"
    if not done.exists():
        shutil.rmtree(run_dir.parent, ignore_errors=True)
        run_dir.parent.mkdir(parents=True)
        start = time.monotonic()
        if cluster is not None:
            chaos_slurm.reference(cluster, overrides(task, run_dir, args), GRPO_CONFIG, run_dir, env, args.timeout)
        else:
            log = run_dir.parent / "reference.log"
            code = subprocess.run(command(task, run_dir, args), stdout=log.open("w"), stderr=subprocess.STDOUT,
                                  env=env, cwd=ROOT).returncode
            if code != 0:
                raise SystemExit(f"the uninterrupted run failed (exit {code}): see {log}")
        done.write_text(f"{time.monotonic() - start:.1f}\n")
    return run_dir


def supervisor(args, task, work: Path, env: dict, disk: Path | None, cluster):
    """The attempts' supervisor of one schedule, its run folder (on ``disk`` when there is one) and logs emptied."""
    run_dir, logs = (disk or work) / "run", work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    lead = ROLLOUT_LEAD.get(args.variant, 0)
    if cluster is not None:
        return chaos_slurm.SlurmSupervisor(cluster, overrides(task, run_dir, args), GRPO_CONFIG, run_dir, logs, env,
                                           args.timeout, disk, lead, ROLLOUT_RANK)
    # Forked ranks from the shared fork server this process offers, if it does (the tests: no server of each attempt's
    # own to start and preload, 6-7 s of CPU per attempt; rank_pid knows them by their parent); else among the
    # command's descendants, where rank_pid finds them: a server of its own (no shared one's offer)
    shared = offered_server_pid(env) if args.ranks == "forked" else None
    return Supervisor(command(task, run_dir, args), run_dir, logs, env if shared else without_offer(env), args.timeout,
                      disk, lead, RANK_PROGRAMS[args.ranks], shared)


def summarise(schedule: list[Fault], checks: dict, run: dict) -> dict:
    met = [f for f in schedule if "seconds_to_exit" in f.record]
    exits = [f.record["seconds_to_exit"] for f in met]
    nexts = [f.record["seconds_to_next_step"] for f in met if f.record.get("seconds_to_next_step") is not None]
    by_kind: dict[str, int] = {}
    for fault in met:
        by_kind[fault.kind] = by_kind.get(fault.kind, 0) + 1
    failures = [f for f in met if f.kind not in STOPS]
    return {"faults_met": len(met), "missed": len(schedule) - len(met), "by_kind": by_kind,
            "bit_equal": checks["weights"].get("bit_equal", False), "metrics_equal": checks["metrics_equal"],
            "prompts_lost": checks["prompts_lost"], "prompts_repeated": checks["prompts_repeated"],
            "causes_named": sum(bool(f.record.get("cause_named")) for f in met),
            "failures_in_history": sum(bool(f.record.get("in_failure_history")) for f in failures),
            "failures": len(failures), "hangs": sum(bool(f.record.get("hang")) for f in met),
            "ended": run["final_exit_codes"][-1:] == [0],
            "seconds_to_exit_mean": round(sum(exits) / len(exits), 2) if exits else None,
            "seconds_to_exit_max": max(exits, default=None),
            "seconds_to_next_step_mean": round(sum(nexts) / len(nexts), 2) if nexts else None,
            "seconds_to_next_step_max": max(nexts, default=None)}


def _mount(disk: Path, mib: int) -> bool:
    disk.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(disk)],
                          capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the schedule: kinds, order, steps, ranks, moments")
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kinds", default=",".join(KINDS), help="the kinds the schedule draws from")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="prm")
    parser.add_argument("--launcher", choices=["local", "slurm"], default="local",
                        help="local: torchrun restarted by this supervisor; slurm: launch/slurm/train.sbatch on the "
                             "tests' two-node cluster, restarted by its requeue (bench/chaos_slurm.py; root)")
    parser.add_argument("--ranks", choices=sorted(RANK_PROGRAMS), default="interpreters",
                        help="--launcher local: each rank a new interpreter under torch's torchrun (the recorded "
                             "schedules), or forked from a preloaded server by grpo-mega's launcher, as "
                             "`grpo-mega train --nproc 2` starts them on a CPU build of torch")
    parser.add_argument("--timeout", type=int, default=15, help="trainer.collective_timeout_s of the runs")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--disk-mib", type=int, default=256, help="size of the tmpfs the run folder is on (disk_full)")
    parser.add_argument("--reuse", action="store_true", help="keep a finished schedule's record; do not rerun it")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos.json")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if args.ranks == "forked" and args.launcher != "local":
        parser.error("--ranks forked is for --launcher local (the SLURM launcher forks its ranks where it can)")
    forked = "-forked" if args.ranks == "forked" else ""
    key = f"{args.variant}-{args.launcher}{forked}-seed{args.seed}-faults{args.faults}-steps{args.steps}"
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    schedules = results.setdefault("schedules", {})
    if args.reuse and schedules.get(key, {}).get("finished"):
        print(f"{key}: kept from {schedules[key]['date']} (--reuse)")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-chaos-"))
    env = dict(os.environ, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(GRACE_S), OMP_NUM_THREADS="1")
    task = build_fault_task(work / "task", needs_prm=True, env=env)
    load_before = os.getloadavg()
    # The tmpfs first: the SLURM nodes' mount namespaces are copies made when their slurmd starts.
    disk = work / key / "disk" if "disk_full" in kinds else None
    note = None
    if disk is not None and not _mount(disk, args.disk_mib):
        kinds.remove("disk_full")
        disk, note = None, "disk_full left out: mounting a tmpfs needs root"
    schedule = draw_schedule(random.Random(args.seed), kinds, args.faults, args.steps, args.save_every)
    for fault in schedule:
        fault.rank = PLANTED_RANKS.get(args.variant, {}).get(fault.kind, fault.rank)
    try:
        with chaos_slurm.two_node_cluster() if args.launcher == "slurm" else contextlib.nullcontext() as cluster:
            reference_dir = reference(args, task, work, env, cluster)
            run = run_schedule(schedule, supervisor(args, task, work / key, env, disk, cluster), args.seed)
        checks = compare_runs(Path(run["run_dir"]), reference_dir, args.steps)
    finally:
        if disk is not None:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    record = {"summary": summarise(schedule, checks, run), "checks": checks, "run": run,
              "faults": [fault.as_dict() for fault in schedule], "note": note,
              "finished": run["final_exit_codes"][-1:] == [0], "reference_seconds": float(
                  (reference_dir.parent / "done").read_text()),
              "load_average_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
              "command": "python bench/chaos.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results = json.loads(args.out.read_text()) if args.out.exists() else {}  # another schedule may have written
    results.setdefault("schedules", {})[key] = record
    results.update(machine=f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
                   torchrun_grace_s=GRACE_S)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(key, json.dumps(record["summary"]), flush=True)
    print(args.out)
    return 0 if record["summary"]["bit_equal"] and record["summary"]["metrics_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
