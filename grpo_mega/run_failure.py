"""A failed run names its cause once: ``run_dir/failure.json`` and one line on stderr, from the first rank that saw
it.

The commands (``grpo-mega train``, ``sft``, ``prm train``) catch what ends a rank and call :func:`record_failure`:
the step and phase the rank was in (the harness and the trainer keep :data:`POSITION` current), the rank, the host,
the exception, the time, and a ``cause`` a person or a requeue policy can act on. The file is created exclusively
(``O_EXCL``), so the first rank to fail writes it and the others, which usually fail because of the first (a peer
lost, a collective timed out waiting for it), do not overwrite it; each still prints its own line.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

FAILURE_FILE = "failure.json"

POSITION: dict[str, Any] = {"step": None, "phase": "start-up"}
"""Where this rank is: the step in flight (None before the first) and the phase of it."""

_TIMEOUT_MARKS = ("timed out", "timeout", "watchdog caught collective operation timeout")
_PEER_LOST_MARKS = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket closed",
                    "connection refused", "ncclremoteerror", "remote process exited")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark this rank as being in phase ``name`` (generation, update, sync, save, ...) while the block runs."""
    previous = POSITION["phase"]
    POSITION["phase"] = name
    try:
        yield
    finally:
        POSITION["phase"] = previous


def set_step(step: int | None) -> None:
    POSITION["step"] = step


def classify(error: BaseException) -> str:
    """What kind of failure ``error`` is: ``collective_timeout`` (a peer hung, stopped or too slow: transient),
    ``peer_lost`` (a peer process or node died: transient), ``non_finite`` (a NaN / Inf loss or gradient norm),
    ``config`` (a bad config), ``interrupted`` (KeyboardInterrupt), else ``error``."""
    name = type(error).__name__
    message = str(error).lower()
    if name == "NonFiniteError":
        return "non_finite"
    if name == "ConfigError":
        return "config"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    distributed = name in ("DistBackendError", "DistNetworkError", "DistError", "DistStoreError") or "gloo" in message \
        or "nccl" in message or "c10d" in message
    if distributed and any(mark in message for mark in _TIMEOUT_MARKS):
        return "collective_timeout"
    if distributed and any(mark in message for mark in _PEER_LOST_MARKS):
        return "peer_lost"
    return "error"


def _rank() -> int:
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def record_failure(run_dir: str | Path, error: BaseException) -> tuple[dict, Path | None]:
    """The failure record of ``error`` on this rank, written to ``run_dir/failure.json`` unless a rank wrote one
    first; returns (record, the path when this rank wrote it)."""
    record = {"step": POSITION["step"], "phase": POSITION["phase"], "rank": _rank(), "host": socket.gethostname(),
              "cause": classify(error), "exception": f"{type(error).__name__}: {error}"[:4000],
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix_time": time.time()}
    path = Path(run_dir) / FAILURE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x") as out:
            json.dump(record, out, indent=1)
    except FileExistsError:
        return record, None
    except OSError:  # an unwritable or full run_dir must not hide the original error
        return record, None
    return record, path


def failure_line(command: str, record: dict, path: Path | None) -> str:
    """The one stderr line of a failure."""
    where = f"step {record['step']}" if record["step"] is not None else "before the first step"
    written = f"; {path}" if path is not None else ""
    return (f"{command}: rank {record['rank']} on {record['host']} failed at {where} ({record['phase']}): "
            f"{record['cause']}: {record['exception'].splitlines()[0][:300]}{written}")


def report_failure(command: str, run_dir: str | Path, error: BaseException) -> dict:
    """Record what ended this rank (:func:`record_failure`) and print its one line on stderr; returns the record."""
    record, path = record_failure(run_dir, error)
    print(failure_line(command, record, path), file=sys.stderr, flush=True)
    return record

