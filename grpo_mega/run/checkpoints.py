"""A run folder's checkpoints as files, read without torch: whether a checkpoint folder is complete
(:func:`checkpoint_problem`) and which one a run would resume from (:func:`newest_complete`). The checkpoint
manager (``grpo_mega.checkpoint.training``) writes and loads them; the run folder guard (``grpo_mega.run.folder``)
reads them in the command's own process, before any rank starts.

Completeness is checked against ``complete.json``'s listing of file sizes (:func:`checkpoint_problem`: cheap, it
runs on every save's pruning and in the light processes; it catches what crashes and full disks do, missing and
truncated files). Content is checked against the CRC-32 of every file that ``complete.json`` records beside the
sizes (``checksums``, computed at the save by the rank that wrote the file, while the file is still in its page
cache): :func:`checksum_problem` catches a same-size alteration (a storage fault, a file overwritten by hand), and
runs before a checkpoint is resumed or loaded, with the reading shared among the ranks
(``grpo_mega.checkpoint.training``). Checkpoints saved before checksums existed have no ``checksums``: they are
checked by size only, with a note. zlib's CRC-32 needs no dependency and ran at 6.5 GB/s on one core of the
2-core test machine (xxhash's xxh3 at 30 GB/s, but it is only a transitive dependency of wandb here);
``bench/checkpoint_checksum.py`` measures what it adds to a save.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from grpo_mega.run.layout import CHECKPOINTS_DIR, COMPLETE_FILE, CONFIG_FILE, LATEST_FILE, STATE_FILE, STEP_DIR, TMP_PREFIX

FORMAT_NAME = "grpo_mega.training_checkpoint"
FORMAT_VERSION = 1
# dist_checkpointing writes this file last on a successful save; without it megatron cannot load at all.
DIST_CHECKPOINT_METADATA = "metadata.json"
# The DeepSpeed engine's counterpart (grpo_mega.engine.deepspeed_checkpoint), written after every rank's files.
DEEPSPEED_METADATA = "deepspeed/grpo_mega_deepspeed.json"


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete, loadable training checkpoint; None when it is.

    Complete means: not a staging folder (``.tmp-*``); ``complete.json`` exists, parses, names this format
    and (for a ``step_N`` folder) step N; every file it lists exists with its recorded size.
    """
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    if path.name.startswith(TMP_PREFIX):
        return f"{path.name} is the staging folder of a save that was not published"
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        return f"{COMPLETE_FILE} is missing (the save did not finish)"
    try:
        complete = json.loads(marker.read_text())
        files = {str(name): int(size) for name, size in complete["files"].items()}
        step = int(complete["step"])
        kind = (complete["format"], complete["version"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{COMPLETE_FILE} is unreadable ({type(error).__name__}: {error})"
    if kind != (FORMAT_NAME, FORMAT_VERSION):
        return f"{COMPLETE_FILE} names format {kind}, expected {(FORMAT_NAME, FORMAT_VERSION)}"
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != step:
        return f"{COMPLETE_FILE} records step {step}, but the folder is named {path.name}"
    for required in (STATE_FILE, CONFIG_FILE):
        if required not in files:
            return f"{COMPLETE_FILE} does not list {required}"
    if DIST_CHECKPOINT_METADATA not in files and DEEPSPEED_METADATA not in files:
        return f"{COMPLETE_FILE} lists neither {DIST_CHECKPOINT_METADATA} nor {DEEPSPEED_METADATA}"
    for name, size in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {COMPLETE_FILE} recorded {size} (truncated or overwritten)"
    return None


CHECKSUM_ALGORITHM = "crc32"
"""What ``complete.json``'s ``checksums`` hold: zlib's CRC-32 of each file, as 8 hex digits."""
CHECKSUM_CHUNK = 8 << 20
"""Bytes read at a time while checksumming (a file is streamed, never held whole)."""
_WRITER_RANK = re.compile(r"__(\d+)_\d+\.distcp$")
"""dist_checkpointing's data files are ``__<global rank>_<n>.distcp``: written by that rank."""


def file_checksum(path: str | os.PathLike) -> str:
    """The CRC-32 of the file ``path`` (streamed), as 8 hex digits."""
    crc = 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(CHECKSUM_CHUNK)
        view = memoryview(buffer)
        while read := handle.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return f"{crc:08x}"


def writer_rank(name: str) -> int | None:
    """The global rank that wrote the checkpoint file ``name`` when its name says it (dist_checkpointing's data
    files); None for the others (rank 0 writes or publishes them)."""
    match = _WRITER_RANK.search(name)
    return int(match.group(1)) if match else None


def checksums_of(folder: str | os.PathLike, names: Iterable[str]) -> dict[str, str]:
    """{name: :func:`file_checksum`} of the files ``names`` (relative POSIX paths) under ``folder``."""
    return {name: file_checksum(Path(folder) / name) for name in names}


def read_listing(path: str | os.PathLike) -> dict[str, int]:
    """{name: size} of every file ``complete.json`` of the checkpoint ``path`` lists."""
    return {str(name): int(size) for name, size in json.loads((Path(path) / COMPLETE_FILE).read_text())["files"].items()}


def recorded_checksums(path: str | os.PathLike) -> dict[str, str] | None:
    """The checksums ``complete.json`` of the checkpoint ``path`` records, {name: hex}; None for a checkpoint saved
    before checksums (or with another algorithm: checked by size only)."""
    complete = json.loads((Path(path) / COMPLETE_FILE).read_text())
    checksums = complete.get("checksums")
    if not isinstance(checksums, dict) or complete.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        return None
    return {str(name): str(value) for name, value in checksums.items()}


def checksum_mismatch(path: str | os.PathLike, name: str, expected: str) -> str | None:
    """Why the file ``name`` of the checkpoint ``path`` does not match its recorded checksum ``expected``, in one
    line (file, expected, found); None when it matches."""
    file = Path(path) / name
    try:
        found = file_checksum(file)
    except OSError as error:
        return f"{file}: cannot be read to verify it ({error})"
    if found == expected:
        return None
    return (f"{file}: {CHECKSUM_ALGORITHM} {found} on disk, {COMPLETE_FILE} recorded {expected} at the save "
            "(the file changed after it was saved)")


def checksum_problem(path: str | os.PathLike, names: Iterable[str] | None = None) -> str | None:
    """The first file of the checkpoint ``path`` (of ``names``, default all it records) whose content no longer
    matches its recorded checksum, in one line; None when all match or none are recorded (an older checkpoint)."""
    recorded = recorded_checksums(path)
    if recorded is None:
        return None
    for name in sorted(recorded if names is None else names):
        problem = checksum_mismatch(path, name, recorded[name])
        if problem is not None:
            return problem
    return None


def step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``checkpoints/step_N`` folder of ``run_dir`` (complete or not) as (N, path), newest step first."""
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    if not checkpoints.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in checkpoints.iterdir()
             if entry.is_dir() and (match := STEP_DIR.match(entry.name))]
    return sorted(found, reverse=True)


def newest_complete(run_dir: str | os.PathLike, warn: Callable[[str], None] = lambda message: None,
                    skip: Collection[Path] = ()) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names if complete, else the newest complete ``step_N`` of ``run_dir``,
    else None (``trainer.resume: auto``); ``warn`` is told of every folder skipped and why. The folders in ``skip``
    (found altered by their checksums) are passed over without a word."""
    latest_target = None
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    latest = checkpoints / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        if STEP_DIR.match(name) and checkpoints / name in skip:
            latest_target = checkpoints / name
        elif STEP_DIR.match(name):
            latest_target = checkpoints / name
            problem = checkpoint_problem(latest_target)
            if problem is None:
                return latest_target
            warn(f"{latest} names {name}, which cannot be loaded: {problem}; looking for an older one")
        else:
            warn(f"{latest} holds {name!r}, not a checkpoint folder name; ignoring it")
    for _, path in step_dirs(run_dir):
        if path == latest_target or path in skip:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    return None
