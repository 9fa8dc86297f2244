"""Can a run write its folder? Checked in the command's own process before any rank starts: a ``trainer.run_dir``
that is a file, lies under a file, is on a read-only or full file system, or in a folder this user cannot write
was found only at the first save, 17-36 s after launch, as a bare ``FileExistsError`` / ``PermissionError`` on one
rank and a second line from the rank that lost it (issue 79).

The check writes and removes a small probe file (:data:`PROBE_BYTES`, flushed to disk) in the run folder, or in its
nearest existing parent when it does not exist yet, which it does not create: a permission, a read-only mount or a
disk with no room left each fail that write as they would fail the checkpoint's (root passes mode bits, so only a
real write tells)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

PROBE_BYTES = 64 * 1024
"""The probe's size: enough that a full disk refuses it (an empty file needs only an inode)."""

_WHY = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
        errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
        errno.EPERM: "permission denied"}


def run_dir_problem(run_dir: str | os.PathLike, key: str = "trainer.run_dir") -> str | None:
    """Why a run cannot write ``run_dir`` (one line naming ``key``), or None."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        return f"{key}={run_dir} is a file, not a folder: name a folder (it is created when missing)"
    folder = run_dir
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{key}={run_dir}: {folder} is a file, so no folder can be made under it: name another folder"
    probe = folder / f".grpo-mega-write-check-{os.getpid()}"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(descriptor, b"\0" * PROBE_BYTES)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError as error:
        why = _WHY.get(error.errno, error.strerror or str(error))
        where = "in it" if folder == run_dir else f"in {folder}, where it would be made"
        return f"{key}={run_dir}: cannot write {where} ({why}): free space or name another folder" \
            if error.errno in (errno.ENOSPC, errno.EDQUOT) else \
            f"{key}={run_dir}: cannot write {where} ({why}): name a folder this user can write"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None
