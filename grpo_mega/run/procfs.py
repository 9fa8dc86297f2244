"""What Linux's ``/proc`` says of a process: its state, its parent, its command line. Each read tolerates a process
that ends between two reads (it is then gone: no fields, not alive)."""

from __future__ import annotations

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
