"""What Linux's ``/proc`` says of a process: its state, its parent, its command line. Each read tolerates a process
that ends between two reads (it is then gone: no fields, not alive)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent, process group, ...); [] for a
    process gone. The name is cut at its last ``)``: it may hold spaces and brackets itself."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def alive(pid: int | str) -> bool:
    """Whether ``pid`` runs: a zombie does not (where PID 1 reaps nothing, an ended process stays one)."""
    return stat_fields(pid)[:1] not in ([], ["Z"], ["X"])


def parent_of(pid: int | str) -> int | None:
    """``pid``'s parent; None for a process gone."""
    fields = stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else None


def command_line(pid: int | str) -> bytes:
    """``pid``'s arguments, NUL-separated as the kernel keeps them; b"" for a process gone (and for one in the middle
    of an exec, before the kernel has laid out its new arguments)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def processes_started_with(name: str, value: str) -> dict[int, str]:
    """pid -> command line (cut at 160 characters) of every running process (not a zombie) whose environment held
    ``name=value`` when it started: how a job's processes are found after their launcher died, since ranks lead
    sessions of their own and an orphan is reparented to init (exec'd and forked processes alike inherit it)."""
    needle = f"\0{name}={value}\0".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in b"\0" + environ + b"\0" and alive(entry.name):
            found[int(entry.name)] = command_line(entry.name).replace(b"\0", b" ").decode(errors="replace")[:160]
    return found


def processes_left_after(name: str, value: str, timeout: float) -> dict[int, str]:
    """The processes started with ``name=value`` (:func:`processes_started_with`) still running ``timeout`` seconds
    from now, or as soon as none is; those left are then SIGKILLed, so a check that finds them leaks none."""
    deadline = time.monotonic() + timeout
    while (left := processes_started_with(name, value)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
