"""A failed run names its cause once: ``run_dir/failure.json`` and one line on stderr, from the first rank that saw
it.

The commands (``grpo-mega train``, ``sft``, ``prm train``) catch what ends a rank and call :func:`report_failure`:
the step and phase the rank was in (the harness and the trainer keep :data:`POSITION` current; an exception keeps
the innermost phase it left), the rank, the host, the exception, the time, and a ``cause`` a person or a requeue
policy can act on (:data:`TRANSIENT_CAUSES`: a requeue may succeed; the others fail the same way again). The file
is published exclusively (a hard link of a fully written temporary file), so the first rank to fail writes it and
the others, which usually fail because of the first (a peer lost, a collective timed out waiting for it), do not
overwrite it; a full disk leaves no file rather than an empty one. A rank prints one line per cause::

    grpo-mega train: rank 1 on node7 failed (cause=peer_lost) at step 12 (update): RuntimeError: ...; run/failure.json

(a rank whose failure is the one failure.json already names, as when every rank reads the same bad data row, or a
consequence of it, as a peer lost after the rank that wrote it stopped, prints nothing more), and keeps its
traceback out of the terminal: in failure.json (``traceback``) and in ``run_dir/tracebacks/rank<R>.txt``
(``GRPO_MEGA_TRACEBACK=1`` prints it on stderr as well).

Phases opened with ``bounded=True`` (the weight sync, the vLLM wake / sleep, PRM scoring, the checkpoint save:
work that no collective timeout bounds) are also watched by the :class:`grpo_mega.run.watchdog.PhaseWatchdog` the
run installed, which ends the process with cause ``phase_timeout`` when one runs past its deadline.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Protocol

from grpo_mega.run.layout import FAILURE_FILE, TRACEBACKS_DIR


POSITION: dict[str, Any] = {"step": None, "phase": "start-up", "signal": None}
"""Where this rank is: the step in flight (None before the first), the phase of it, and the stop signal it received
(None before one)."""

TRANSIENT_CAUSES = ("collective_timeout", "peer_lost", "phase_timeout", "hardware", "terminated")
"""Causes a restart can get past (a peer hung or died, a node or GPU failed, the rank was being torn down): the
SLURM scripts requeue on them. ``config``, ``data``, ``non_finite``, ``disk_full``, ``interrupted`` and ``error``
fail again the same way."""

CONSEQUENTIAL_CAUSES = ("collective_timeout", "peer_lost", "terminated")
"""Causes a rank usually has because another rank failed first (it waited for it, lost it, or was torn down after
it): such a rank waits :data:`DEFER_S` before claiming failure.json, so that the rank at the root of the failure (a
hang of its own, an exception) names it."""
DEFER_S = 3.0
DEFER_AFTER_SIGNAL_S = 0.5
"""The whole wait of a rank that receives a stop signal before it failed or during the wait: it is being torn down,
and a launcher may kill it within seconds (srun ends a step once a task failed; torchrun's agent, having lost the
store, closes its ranks), while the rank at the root of the failure, if it could name it, did so before it exited.
Measured before: under SLURM a rollout rank that found its trainer SIGKILLed was itself killed during the 3 s wait,
leaving no failure.json."""
SHARED_CAUSES = ("disk_full",)
"""Causes every rank meets at once, since they all write to the run folder (a save is a collective): a rank other
than 0 waits :data:`DEFER_S` for rank 0 to name it, and stays silent once failure.json names the same cause,
whatever its message says (the space left it measured differs from rank to rank). Measured before: a checkpoint
too large for the disk printed one ``disk_full`` line per rank (the first ranks found the disk still full and
could write no failure.json; rank 0 wrote it once the partial save was removed)."""

_TIMEOUT_MARKS = ("timed out", "timeout", "watchdog caught collective operation timeout")
_PEER_LOST_MARKS = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket closed",
                    "connection refused", "ncclremoteerror", "remote process exited", "connection was likely closed",
                    "failed to recv", "failed to send", "remote server shutdown")
_NETWORK_ERRORS = {"DistNetworkError", "DistStoreError", "RendezvousConnectionError", "RendezvousClosedError",
                   "RendezvousTimeoutError", "RendezvousStateError"}
"""A lost store, rendezvous or link, however it is first seen (torchrun's agent in its rendezvous, a rank at its
store): a node or process gone, which a restart gets past."""
_HARDWARE_MARKS = ("uncorrectable ecc error", "ecc error", "fallen off the bus", "unspecified launch failure",
                   "busy or unavailable", "nvlink error", "cuda error: unknown error")
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""The errnos of a full file system or an exhausted quota."""
_PHASE_ATTRIBUTE = "_grpo_mega_failed_in"
LINE_CHARS = 2000
"""How much of the exception's first line the stderr line keeps: all of a message that names its fix."""
TRACEBACK_CHARS = 20000
"""How much of a traceback (its end) failure.json and the rank's traceback file keep."""
TRACEBACK_ENV = "GRPO_MEGA_TRACEBACK"
"""Set to 1 to have a failed rank print its traceback on stderr too (it is always in its traceback file)."""


class PhaseTimeout(Exception):
    """A bounded phase ran past its deadline (raised nowhere: the watchdog records it and ends the process)."""


class _Watchdog(Protocol):
    def arm(self, name: str, *, alone: bool) -> object: ...

    def disarm(self, token: object) -> None: ...


_watchdog: _Watchdog | None = None


def set_watchdog(watchdog: _Watchdog | None) -> None:
    """Install (or, with None, remove) the watchdog that bounds the phases opened with ``bounded=True``."""
    global _watchdog
    _watchdog = watchdog


@contextlib.contextmanager
def phase(name: str, *, bounded: bool = False, alone: bool = False) -> Iterator[None]:
    """Mark this rank as being in phase ``name`` (generation, update, sync, save, ...) while the block runs; with
    ``bounded``, the installed watchdog ends the process if the block runs past its deadline: the timeout for a phase
    the rank runs ``alone`` (it waits for no other rank: a vLLM wake-up), the timeout plus a grace for a phase with
    collectives, whose waits the collective timeout names first. An exception leaving the block remembers the
    innermost phase (and step) it left, for :func:`record_failure`."""
    previous = POSITION["phase"]
    POSITION["phase"] = name
    token = _watchdog.arm(name, alone=alone) if bounded and _watchdog is not None else None
    try:
        yield
    except BaseException as error:
        if not hasattr(error, _PHASE_ATTRIBUTE):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, _PHASE_ATTRIBUTE, (POSITION["step"], name))
        raise
    finally:
        if token is not None:
            _watchdog.disarm(token)
        POSITION["phase"] = previous


def set_step(step: int | None) -> None:
    POSITION["step"] = step


def note_signal(name: str | None) -> None:
    """Remember that this rank received stop signal ``name`` (the run-control handler calls it): an error after it
    is most likely the teardown's (torchrun sends SIGTERM to every rank when one fails, and kills the helper
    processes megatron's checkpoint writers talk to), so it is classified ``terminated`` rather than ``error``.
    None forgets it (a run's signal handlers installed or removed)."""
    POSITION["signal"] = name


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or during (``__cause__`` / ``__context__``)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def classify(error: BaseException) -> str:
    """What kind of failure ``error`` is: ``collective_timeout`` (a peer hung, stopped or too slow), ``peer_lost``
    (a peer process or node died, or a helper process a pipe or socket led to), ``phase_timeout`` (a bounded phase
    overran), ``hardware`` (a GPU fault: ECC, off the bus), ``disk_full`` (no space or quota left: ENOSPC / EDQUOT
    anywhere in the chain, or a save that found its file system full), ``non_finite`` (a NaN / Inf loss or gradient
    norm), ``config`` (a bad config), ``data`` (a malformed dataset row), ``interrupted`` (KeyboardInterrupt),
    ``terminated`` (any other error after this rank received a stop signal: see :func:`note_signal`), else
    ``error``. A lost store or rendezvous (:data:`_NETWORK_ERRORS`) is ``peer_lost`` (``collective_timeout`` when it
    timed out), whichever process saw it first."""
    chain = list(exception_chain(error))
    names = {type(link).__name__ for link in chain}
    messages = " | ".join(str(link).lower() for link in chain)
    if "PhaseTimeout" in names:
        return "phase_timeout"
    if "NonFiniteError" in names:
        return "non_finite"
    if names & {"ConfigError", "RunFolderError"}:
        return "config"
    if "BadRowError" in names:
        return "data"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    no_space = any(isinstance(link, OSError) and link.errno in NO_SPACE_ERRNOS for link in chain)
    if no_space or "no space left" in messages or "disk quota exceeded" in messages:
        return "disk_full"
    if any(mark in messages for mark in _HARDWARE_MARKS):
        return "hardware"
    distributed = bool(names & {"DistBackendError", "DistError", *_NETWORK_ERRORS}) \
        or "gloo" in messages or "nccl" in messages or "c10d" in messages
    if distributed and any(mark in messages for mark in _TIMEOUT_MARKS):
        return "collective_timeout"
    if distributed and any(mark in messages for mark in _PEER_LOST_MARKS) or names & _NETWORK_ERRORS:
        return "peer_lost"
    if any(isinstance(link, (ConnectionError, EOFError)) for link in chain):
        return "peer_lost"
    return "terminated" if POSITION["signal"] else "error"


def _rank() -> int:
    """The job-wide rank (a job split into training and rollout worlds rewrites RANK to the world's own and keeps
    the job's in GRPO_MEGA_GLOBAL_RANK: ``grpo_mega.parallel.roles``)."""
    for name in ("GRPO_MEGA_GLOBAL_RANK", "RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def failure_record(error: BaseException, *, in_phase: str | None = None) -> dict:
    """What ended this rank: step, phase (``in_phase``, else the one the error left, else the current one), rank,
    host, cause, exception, time."""
    step, where = getattr(error, _PHASE_ATTRIBUTE, (POSITION["step"], POSITION["phase"]))
    where = in_phase or where
    return {"step": step, "phase": where, "rank": _rank(), "host": socket.gethostname(), "cause": classify(error),
            "exception": "\n".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", [])])[:4000],
            "signal_before": POSITION["signal"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix_time": time.time(),
            "traceback": "".join(traceback.format_exception(error))[-TRACEBACK_CHARS:]}


def write_exclusive(path: Path, record: dict) -> bool:
    """Publish ``record`` as ``path`` unless it exists: written whole to a temporary file first, then hard-linked
    (atomic, fails when ``path`` exists). False when another rank was first or the folder cannot take the file."""
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "w") as out:
            json.dump(record, out, indent=1)
        os.link(temporary, path)
    except OSError:  # FileExistsError: another rank was first; else an unwritable or full run_dir
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
    return True


def _defer(path: Path) -> None:
    """Wait until ``path`` exists (another rank named the failure) or :data:`DEFER_S` has passed, or
    :data:`DEFER_AFTER_SIGNAL_S` once a stop signal has arrived, before the wait or during it (the launcher tearing
    this rank down: measured before, a rollout rank that lost its trainer got srun's SIGTERM 0.2 s into its 3 s wait
    and was killed before the end of it)."""
    began = time.monotonic()
    while not path.exists():
        if time.monotonic() - began >= (DEFER_AFTER_SIGNAL_S if POSITION["signal"] else DEFER_S):
            return
        time.sleep(0.05)


def record_failure(run_dir: str | Path, error: BaseException, *, in_phase: str | None = None
                   ) -> tuple[dict, Path | None]:
    """The failure record of ``error`` on this rank, written to ``run_dir/failure.json`` unless a rank wrote one
    first (a consequential cause waits :data:`DEFER_S` for the root cause first, :data:`DEFER_AFTER_SIGNAL_S` after a
    stop signal, a shared one on a rank other than 0 for rank 0); returns (record, the path when this rank wrote it)."""
    record = failure_record(error, in_phase=in_phase)
    path = Path(run_dir) / FAILURE_FILE
    if record["cause"] in CONSEQUENTIAL_CAUSES or record["cause"] in SHARED_CAUSES and record["rank"] != 0:
        _defer(path)
    return record, (path if write_exclusive(path, record) else None)


def failure_line(command: str, record: dict, path: Path | None) -> str:
    """The one stderr line of a failure; ``failed (cause=...)`` is what the SLURM scripts read."""
    where = f"at step {record['step']}" if record["step"] is not None else "before the first step"
    written = f"; {path}" if path is not None else ""
    what = record['exception'].splitlines()[0][:LINE_CHARS]
    if record["cause"] == "interrupted":  # no error to show: say how to go on instead
        resume = record.get("resume_from")
        what = ("Ctrl-C (SIGINT); the same command resumes from " +
                (f"the checkpoint {resume}" if resume else "the start (no checkpoint was saved yet)"))
    return (f"{command}: rank {record['rank']} on {record['host']} failed (cause={record['cause']}) {where} "
            f"({record['phase']}): {what}{written}")


def set_aside_failure(run_dir: str | Path) -> Path | None:
    """Rename an earlier attempt's ``run_dir/failure.json`` to ``failure.<its mtime>.json`` when a new attempt
    starts, so that the file names this attempt's cause or none; returns the new name (None: there was none)."""
    failure = Path(run_dir) / FAILURE_FILE
    if not failure.exists():
        return None
    kept = failure.with_name(f"failure.{int(failure.stat().st_mtime)}.json")
    try:
        failure.rename(kept)
    except FileNotFoundError:  # another process of the job moved it first
        return None
    return kept


def save_traceback(run_dir: str | Path, record: dict) -> Path | None:
    """Append ``record``'s traceback, under a line naming its time and cause, to ``run_dir/tracebacks/rank<R>.txt``;
    returns the file (None when the folder cannot take it: a full disk loses the traceback, never the run)."""
    path = Path(run_dir) / TRACEBACKS_DIR / f"rank{record['rank']}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as out:
            out.write(f"=== {record['time']} rank {record['rank']} on {record['host']}: cause={record['cause']}, "
                      f"step {record['step']} ({record['phase']})\n{record['traceback']}\n")
    except OSError:
        return None
    return path


def _already_named(run_dir: str | Path, record: dict) -> bool:
    """Whether ``run_dir/failure.json``, written by another rank, already says what ended this rank: the same cause
    and exception (every rank read the same bad row, or hit the same config error), or any cause at all when this
    rank's is consequential (it lost, waited for or was torn down after the rank that wrote the file: a Ctrl-C that
    rank 0 honoured after its save, while rank 1 waited at the next collective), or the same shared cause (a full
    disk: :data:`SHARED_CAUSES`). One line says it for all."""
    try:
        named = json.loads((Path(run_dir) / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if record["cause"] in CONSEQUENTIAL_CAUSES:
        return True
    if record["cause"] in SHARED_CAUSES:
        return named.get("cause") == record["cause"]
    return named.get("cause") == record["cause"] and named.get("exception") == record["exception"]


def report_failure(command: str, run_dir: str | Path | None, error: BaseException) -> dict:
    """Record what ended this rank (:func:`record_failure`, and its traceback with :func:`save_traceback`; only the
    line when there is no run folder yet, as for a config that did not load) and print its one line on stderr,
    unless failure.json already names the same failure; returns the record."""
    if run_dir is None:
        record, path = failure_record(error), None
    else:
        record, path = record_failure(run_dir, error)
        if record["cause"] == "interrupted":
            from grpo_mega.run.checkpoints import newest_complete

            resume = newest_complete(run_dir)
            record["resume_from"] = str(resume) if resume is not None else None
        saved = save_traceback(run_dir, record)
        if path is None and _already_named(run_dir, record):
            return record
        if path is None and saved is not None:
            path = saved
    from grpo_mega.run.progress import close_open_bars

    close_open_bars()  # the bar's line ends first: the cause is a line of its own
    print(failure_line(command, record, path), file=sys.stderr, flush=True)
    if os.environ.get(TRACEBACK_ENV) == "1":
        print(record["traceback"], file=sys.stderr, flush=True)
    return record


def exit_status(record: dict) -> int:
    """The exit status of a command that ended with failure ``record``: 2 for the user's input (``config``,
    ``data``: the status of the CLI's other input errors), 130 for an interrupt (as a shell reports Ctrl-C), else
    1."""
    return {"config": 2, "data": 2, "interrupted": 130}.get(record["cause"], 1)
