"""A run folder's checkpoints as files, read without torch: whether a checkpoint folder is complete
(:func:`checkpoint_problem`) and which one a run would resume from (:func:`newest_complete`). The checkpoint
manager (``grpo_mega.checkpoint.training``) writes and loads them; the run folder guard (``grpo_mega.run.folder``)
reads them in the command's own process, before any rank starts.

Completeness is checked against ``complete.json``'s listing of file sizes rather than content hashes:
hashing a multi-GB model at rank 0 on every save and every resume would cost more than the save, while
sizes catch what crashes and full disks do (missing and truncated files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
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


def step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``checkpoints/step_N`` folder of ``run_dir`` (complete or not) as (N, path), newest step first."""
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    if not checkpoints.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in checkpoints.iterdir()
             if entry.is_dir() and (match := STEP_DIR.match(entry.name))]
    return sorted(found, reverse=True)


def newest_complete(run_dir: str | os.PathLike, warn: Callable[[str], None] = lambda message: None) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names if complete, else the newest complete ``step_N`` of ``run_dir``,
    else None (``trainer.resume: auto``); ``warn`` is told of every folder skipped and why."""
    latest_target = None
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    latest = checkpoints / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        if STEP_DIR.match(name):
            latest_target = checkpoints / name
            problem = checkpoint_problem(latest_target)
            if problem is None:
                return latest_target
            warn(f"{latest} names {name}, which cannot be loaded: {problem}; looking for an older one")
        else:
            warn(f"{latest} holds {name!r}, not a checkpoint folder name; ignoring it")
    for _, path in step_dirs(run_dir):
        if path == latest_target:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    return None
