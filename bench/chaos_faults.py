"""The faults of bench/chaos.py: how each is put into the running job, and how its cause must be named.

A fault is a :class:`Fault` (kind, trigger step, rank); the supervisor in bench/chaos.py starts one attempt of the
run per fault, waits for the trigger (a step row that attempt logged in metrics.jsonl: :func:`step_reached`),
injects it, waits for the job to end, and restarts. The kinds:

  sigkill        SIGKILL of a rank (the OOM killer, a crashed driver)
  sigstop        SIGSTOP of a rank (a hang: the process lives, holds its sockets, answers nothing)
  store_lost     the store's node lost: torchrun's agent (which hosts the c10d store) and rank 0 SIGKILLed at once
  disk_full      the run's file system (a tmpfs) filled to 2 MiB free and held there until the job exits (another
                 tenant writing): the next save finds it full, even after keep_last pruned a checkpoint
  prm_exception  the PRM scorer raising on one rank, mid-step (bench/fault_inject.py)
  sigterm        preemption: SIGTERM to torchrun, as a scheduler sends it; the ranks save the step and stop
  usr1           the scheduler's warning before the time limit: SIGUSR1 to one rank (``srun --signal``)
  save_kill      SIGKILL of a rank inside a checkpoint save, its files written, before publishing (fault_inject.py)
  resume_kill    SIGKILL of a rank as it loads the checkpoint it resumes from (fault_inject.py; right after
                 another fault's exit, on the restart)
  altered        SIGKILL of a rank, then one byte of a file of the newest checkpoint that verifies flipped (same
                 size) before the restart: the restart must refuse it by its checksum and fall back to an older one
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo_mega.checkpoint.training_files import find_checkpoint_folder, read_checkpoint_state
from grpo_mega.run.checkpoints import checksum_problem, checkpoint_problem, read_listing, step_dirs
from grpo_mega.run.failure import TRANSIENT_CAUSES
from grpo_mega.run.layout import CHECKPOINTS_DIR, METRICS_FILE
from faults import rank_pid  # bench/faults.py: a rank's pid by its environment (PROGRAM's default)

KINDS = ("sigkill", "sigstop", "store_lost", "disk_full", "prm_exception", "sigterm", "usr1", "save_kill",
         "resume_kill", "altered")
PLANTED = ("prm_exception", "save_kill", "resume_kill")
"""Kinds bench/fault_inject.py plants inside a rank (``GRPO_FAULT``); the others are sent from outside."""
STOPS = {"sigterm": "SIGTERM", "usr1": "SIGUSR1"}
"""Preemption: the run saves the step in flight and stops (no failure: the cause is the stop line's signal)."""
EXPECTED_CAUSES = {
    "sigkill": set(TRANSIENT_CAUSES), "store_lost": set(TRANSIENT_CAUSES), "save_kill": set(TRANSIENT_CAUSES),
    "resume_kill": set(TRANSIENT_CAUSES), "altered": set(TRANSIENT_CAUSES),
    "sigstop": {"collective_timeout", "phase_timeout"}, "disk_full": {"disk_full"}, "prm_exception": {"error"},
}
FREE_AFTER_FILL = 2 * 2**20
PROGRAM = b"fault_inject.py"


@dataclass
class Fault:
    """One fault of a schedule: ``trigger``: the step after whose metrics row it is injected (planted kinds: the
    step they fire in; ``resume_kill``: none, it fires in the restart after the fault before it)."""
    kind: str
    trigger: int | None
    rank: int
    delay_s: float = 0.0
    """Seconds after the trigger's row before an external fault is sent (a random moment of the next step)."""
    record: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def draw_schedule(rng: random.Random, kinds: list[str], faults: int, steps: int, save_every: int) -> list[Fault]:
    """``faults`` faults of ``kinds`` (each kind at least once when there are enough), in a seeded order, their
    trigger steps increasing over the run. The first comes after two saves (an altered checkpoint and a fault
    during a resume need a checkpoint to act on) and none is the kind ``resume_kill`` (nothing to resume yet)."""
    order = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(order)
    while order[0] == "resume_kill" and len(set(order)) > 1:
        rng.shuffle(order)
    triggered = sum(kind != "resume_kill" for kind in order)
    first = 2 * save_every + 1
    if steps - 2 - first < triggered:
        raise SystemExit(f"--steps {steps} leaves too few steps for {triggered} triggered faults after step {first}")
    triggers = iter(sorted(rng.sample(range(first, steps - 2), triggered)))
    return [Fault(kind, None if kind == "resume_kill" else next(triggers), rng.randrange(2), rng.uniform(0, 1))
            for kind in order]


@dataclass(frozen=True)
class AttemptStart:
    """Where an attempt starts in the run folder, read before its job starts: ``resume_step``, the step of the
    checkpoint ``trainer.resume=auto`` loads (0: none yet), and ``stale``, a metrics row past it that an earlier
    attempt logged before dying ahead of that step's checkpoint (None: there is none). The resume drops such rows
    (``grpo_mega.run.metrics.drop_rows_after``) and logs those steps again, so they tell nothing of this attempt."""
    resume_step: int
    stale: str | None


def resume_step(run_dir: Path) -> int:
    """The step the next attempt resumes from: that of the newest complete checkpoint whose files match their
    checksums (``find_checkpoint_folder``, the ranks' choice: an altered newest one is passed over), 0 when none."""
    if not (run_dir / CHECKPOINTS_DIR).is_dir():
        return 0
    try:
        return int(read_checkpoint_state(find_checkpoint_folder(run_dir))["step"])
    except ValueError:  # no complete checkpoint that verifies: the run starts from step 0
        return 0


def _rows(run_dir: Path) -> list[str]:
    """The complete lines of the run's metrics.jsonl (a row being appended, its newline not yet written, is left out:
    it is read on the next poll), blank ones aside."""
    path = run_dir / METRICS_FILE
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [line.rstrip("\n") for line in lines if line.endswith("\n") and line.strip()]


def attempt_start(run_dir: Path) -> AttemptStart:
    """The :class:`AttemptStart` of the attempt about to start in ``run_dir`` (every rank of the one before gone)."""
    step = resume_step(run_dir)
    return AttemptStart(step, next((row for row in _rows(run_dir) if json.loads(row)["step"] > step), None))


def attempt_steps(run_dir: Path, start: AttemptStart) -> list[int]:
    """The steps of the metrics rows the attempt that began at ``start`` has logged: the rows past its resume step,
    once its resume has dropped the stale ones (until then, none). A row logged again is a new line (its ``time``
    differs), so the stale line still in the file means the drop has not happened yet."""
    rows = _rows(run_dir)
    if start.stale is not None and start.stale in rows:
        return []
    return [step for step in (json.loads(row)["step"] for row in rows) if step > start.resume_step]


def step_reached(run_dir: Path, start: AttemptStart) -> int:
    """The newest step the attempt that began at ``start`` has logged; its resume step while it has logged none."""
    return max(attempt_steps(run_dir, start), default=start.resume_step)


def poll_attempt(run_dir: Path, start: AttemptStart, until, ended) -> tuple[bool, float]:
    """Poll every 50 ms until ``until()`` (True) or ``ended()`` (False); with that, when the attempt that began at
    ``start`` logged its first metrics row (nan: none), not counting the rows its resume drops (a fallback resume
    dropped three in the first SLURM schedule, and the first row was noted 30 s late)."""
    first_row = float("nan")
    while True:
        if first_row != first_row and attempt_steps(run_dir, start):
            first_row = time.time()
        if until():
            return True, first_row
        if ended():
            return False, first_row
        time.sleep(0.05)


def trigger_now(fault: Fault, resume_step: int, rollout_lead: int, rollout_rank: int) -> int | None:
    """The step ``fault`` is triggered at when its attempt resumes from ``resume_step`` (:func:`resume_step`): a
    trigger the run has passed already (an earlier fault's restart went further) moves to the first step the attempt
    trains, and a fault planted on the rollout rank of an async run (``rollout_lead``: bench/chaos.py's
    ROLLOUT_LEAD) further by the steps that world runs ahead. Not the newest metrics row: rows logged past the
    checkpoint by an attempt that died before saving are dropped and trained again (async seed 2, 2026-12-03: the
    triggers drifted by those rows and its last 2 of 20 faults lay past the run's end)."""
    if fault.trigger is None:
        return None
    lead = rollout_lead if fault.kind in PLANTED and fault.rank == rollout_rank else 0
    return max(fault.trigger, resume_step + 1 + lead)


def record_attempt(fault: Fault, run_dir: Path, log: str, attempt: int, trigger: int | None, exit_code: int | None,
                   hung: bool, fault_at: float | None, ended: float) -> None:
    """What one attempt that met ``fault`` did, into ``fault.record``: ``log`` is the attempt's output, ``fault_at``
    when the fault was put in (None: it never was), ``ended`` when the job's last rank was gone."""
    failure_path = run_dir / "failure.json"
    failure = json.loads(failure_path.read_text()) if failure_path.exists() else None
    if failure is not None and fault_at is not None and failure.get("unix_time", 0) < fault_at - 1:
        failure = None  # an earlier attempt's, not set aside: this attempt wrote none
    stop = re.search(r"stopped after step \d+ \([^)]*\)", log)
    fault.record.update(attempt=attempt, trigger_used=trigger, exit_code=exit_code, hang=hung,
                        failure=None if failure is None else {k: failure.get(k) for k in
                                                              ("cause", "rank", "phase", "step", "unix_time")},
                        stop_line=stop.group(0) if stop else None)
    if fault_at is None:
        fault.record["missed"] = "the attempt ended before the fault" if exit_code is not None else "no rank"
        return
    fault.record.update(fault_at=fault_at, seconds_to_exit=round(ended - fault_at, 2), exited_at=ended)


def planted_env(fault: Fault, step: int | None) -> dict[str, str]:
    """``GRPO_FAULT`` for a planted kind, to fire at ``step`` (empty for the others)."""
    if fault.kind not in PLANTED:
        return {}
    return {"GRPO_FAULT": f"{fault.kind}:{fault.rank}:{step or 0}"}


class DiskFill:
    """The disk_full fault: ``fill`` leaves ``FREE_AFTER_FILL`` bytes free on ``disk``, and a thread tops the filler
    up whenever the run frees space (keep_last pruning an old checkpoint freed a save's worth in seed 2's fault 9 of
    2026-12-02, and the run went on to its end: the fault undid itself) until ``release``, after the job's exit."""

    def __init__(self, disk: Path):
        self.disk, self.path = disk, disk / "filler"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.top_ups = 0

    def _top_up(self) -> None:
        """Grow the filler until ``FREE_AFTER_FILL`` is left, in pieces of at most 8 MiB measured afresh: the run
        writes meanwhile, and one allocation of all the free space it measured failed with ENOSPC (async seed 0's
        fault 9, 2026-12-02)."""
        with open(self.path, "ab") as out:
            for _ in range(4096):  # a 256 MiB tmpfs needs 32 pieces; the bound only keeps a broken disk from looping
                want = min(shutil.disk_usage(self.disk).free - FREE_AFTER_FILL, 8 * 2**20)
                if want <= 0:
                    return
                try:
                    os.posix_fallocate(out.fileno(), out.seek(0, os.SEEK_END), want)
                except OSError:  # the run took that space first: measure again, or give up once nothing is left
                    if shutil.disk_usage(self.disk).free <= FREE_AFTER_FILL + 2**20:
                        return

    def fill(self) -> None:
        self._top_up()
        self._thread = threading.Thread(target=self._hold, name="disk-fill", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        while not self._stop.wait(0.05):
            if shutil.disk_usage(self.disk).free > FREE_AFTER_FILL + 2**16:
                self._top_up()
                self.top_ups += 1

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)

    def release_after(self, record: dict, run_dir: Path) -> None:
        """After the job's exit: what the run did with the space left (into the fault's ``record``, when the fill
        happened), then the space back for the restart."""
        if "disk" in record:
            record["disk"].update(free_at_exit=shutil.disk_usage(self.disk).free,
                                  checkpoints_at_exit=checkpoint_bytes(run_dir), top_ups=self.top_ups)
        self.release()


def inject(fault: Fault, agent_pid: int, run_dir: Path, disk_fill: DiskFill | None,
           program: bytes = PROGRAM, shared_server: int | None = None) -> float | None:
    """Send an external fault to the running job (``program``: what its ranks run, and ``shared_server``: the
    shared fork server its ranks are forked from, if any, for rank_pid); returns its time (None: its rank was
    already gone)."""
    kind = fault.kind
    if kind == "disk_full":
        if disk_fill is None:
            raise SystemExit("a disk_full fault needs the run on its own file system (bench/chaos.py mounts a tmpfs)")
        free = shutil.disk_usage(disk_fill.disk).free
        disk_fill.fill()
        fault.record["disk"] = {"free_before_fill": free, "free_after_fill": shutil.disk_usage(disk_fill.disk).free,
                                "checkpoints_at_fill": checkpoint_bytes(run_dir)}
        return time.time()
    if kind == "sigterm":
        os.kill(agent_pid, signal.SIGTERM)
        return time.time()
    rank = 0 if kind == "store_lost" else fault.rank
    pid = rank_pid(rank, run_dir, program, shared_server)
    if pid is None:
        return None
    if kind == "store_lost":  # the node that hosts the store: its agent and its rank together
        os.kill(agent_pid, signal.SIGKILL)
    os.kill(pid, {"sigstop": signal.SIGSTOP, "usr1": signal.SIGUSR1}.get(kind, signal.SIGKILL))
    return time.time()


def checkpoint_bytes(run_dir: Path) -> dict[str, int]:
    """{folder name: bytes in it} of every folder in the run's checkpoints/ (staging folders included)."""
    folder = run_dir / "checkpoints"
    sizes = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        try:
            sizes[path.name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        except OSError:  # removed while counted (a prune, a staging folder published)
            continue
    return sizes


def alter_newest(run_dir: Path, rng: random.Random) -> dict:
    """Flip one byte in the middle of a file (drawn by ``rng``) of the newest checkpoint whose files still match
    their checksums, when an older one that matches is left to fall back to; returns what was altered."""
    verified = [path for _, path in step_dirs(run_dir)
                if checkpoint_problem(path) is None and checksum_problem(path) is None]
    if len(verified) < 2:
        return {"altered": None, "why_not": f"{len(verified)} checkpoint(s) verify: none left to fall back to"}
    target = verified[0]
    names = sorted(name for name, size in read_listing(target).items() if size > 0)
    name = rng.choice(names)
    file = target / name
    offset = file.stat().st_size // 2
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    return {"altered": str(file.relative_to(run_dir)), "checkpoint": target.name, "offset": offset,
            "fallback_expected": verified[1].name}


def failure_history(run_dir: Path) -> list[dict]:
    """Every failure record of the run (failure.json and the earlier attempts' failure.<time>.json), oldest first."""
    records = []
    for path in run_dir.glob("failure*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda record: record.get("unix_time", 0))


def cause_named(fault: Fault, failure: dict | None, log: str, restart_log: str,
                stops: dict[str, str] = STOPS) -> tuple[bool, str]:
    """Whether the fault's cause is named where it must be, and what named it (one line); ``stops``: the signal
    each preemption kind's stop line names (under SLURM the batch shell turns a USR1 into a SIGTERM to the step)."""
    kind = fault.kind
    if kind in stops:
        line = re.search(r"stopped after step \d+ \(([^)]*)\)", log)
        said = line.group(1) if line else None
        return bool(said and (stops[kind] in said or "another rank" in said)), f"stop line: {said}"
    if failure is None:
        return False, "no failure.json"
    named = f"failure.json: cause={failure.get('cause')} rank={failure.get('rank')} phase={failure.get('phase')}"
    right = failure.get("cause") in EXPECTED_CAUSES[kind]
    if kind == "prm_exception":
        right = right and failure.get("phase") == "prm scoring" and failure.get("rank") == fault.rank
    if kind == "altered" and fault.record.get("altered"):
        altered = fault.record["altered"]
        file_named = re.search(rf"refusing checkpoint \S*{re.escape(fault.record['checkpoint'])}: \S*"
                               rf"{re.escape(altered.split('/', 2)[-1])}: crc32", restart_log)
        fell_back = re.search(rf"resuming from \S*{re.escape(fault.record['fallback_expected'])}", restart_log)
        right = right and bool(file_named) and bool(fell_back)
        named += f"; restart refused it: {bool(file_named)}, fell back to {fault.record['fallback_expected']}: " \
                 f"{bool(fell_back)}"
    return right, named
