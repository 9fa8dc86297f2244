"""A training checkpoint folder on disk: atomic small-file writes, what a folder holds, its state file.

The folder's layout and its names (``checkpoints/step_N``, ``latest``, ``complete.json``, ...) are
``grpo_mega.run.layout``'s and the completeness check (:func:`checkpoint_problem`) is ``grpo_mega.run.checkpoints``',
which import no torch, so the light processes read them too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

from grpo_mega.run.checkpoints import (  # noqa: F401  (their home; imported here by the checkpoint layer's users)
    DEEPSPEED_METADATA,
    DIST_CHECKPOINT_METADATA,
    FORMAT_NAME,
    FORMAT_VERSION,
    checkpoint_problem,
    checksum_problem,
    newest_complete,
)
from grpo_mega.run.failure import NO_SPACE_ERRNOS, exception_chain
from grpo_mega.run.layout import (
    CHECKPOINTS_DIR,
    COMPLETE_FILE,
    LATEST_FILE,
    STATE_FILE,
    TMP_PREFIX,
    step_dir_name,
)

logger = logging.getLogger(__name__)

MCORE_MODEL_INFO_FILE = "grpo_mega_model.json"
"""The file that makes a folder a megatron model folder (``grpo_mega.checkpoint.mcore_checkpoint``'s ``INFO_FILE``)."""


def read_checkpoint_state(path: str | os.PathLike) -> dict:
    """``grpo_mega_checkpoint.json`` of a complete checkpoint; ValueError naming the folder and why otherwise."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"{path} is not a complete training checkpoint: {problem}")
    info = json.loads((path / STATE_FILE).read_text())
    if (info.get("format"), info.get("version")) != (FORMAT_NAME, FORMAT_VERSION):
        raise ValueError(
            f"{path / STATE_FILE}: format {info.get('format')!r} version {info.get('version')!r}, "
            f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    return info


def find_checkpoint_folder(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder meant by ``path``: the folder itself, or a run directory's newest complete
    checkpoint whose files match their checksums (an altered one is refused, with a warning, for the one before);
    in this process only (``grpo_mega.checkpoint.source.locate_checkpoint`` is the collective one). ValueError when
    there is none, or when the folder named is altered (file, expected, found). Imports no torch: the checks before
    a launch (``model.init_from``, a PRM) call it in the command's own process."""
    path = Path(path)
    if (path / CHECKPOINTS_DIR).is_dir() and not (path / COMPLETE_FILE).exists():
        refused: list[Path] = []
        while (newest := newest_complete(path, warn=logger.warning, skip=refused)) is not None:
            problem = checksum_problem(newest)
            if problem is None:
                if refused:
                    logger.warning("using %s, the newest checkpoint of %s whose files match their checksums "
                                   "(refused: %s)", newest, path, ", ".join(p.name for p in refused))
                return newest
            logger.warning("refusing checkpoint %s: %s; looking for an older one", newest, problem)
            refused.append(newest)
        altered = f" that verifies (altered: {', '.join(p.name for p in refused)})" if refused else ""
        raise ValueError(f"run directory {path} holds no complete checkpoint{altered}")
    problem = checksum_problem(path) if checkpoint_problem(path) is None else None  # content before reading any
    if problem is not None:
        raise ValueError(f"checkpoint {path} is refused: {problem}")
    read_checkpoint_state(path)
    return path


def weights_format(path: str | os.PathLike) -> str:
    """What kind of weights folder ``path`` is, for ``model.init_from``.

    Returns ``training_checkpoint`` (a grpo-mega checkpoint folder), ``training_run`` (a grpo-mega run
    directory with ``checkpoints/``), ``mcore_model`` (``grpo_mega.checkpoint.save_mcore_checkpoint``) or
    ``hf`` (a Hugging Face folder: config.json and safetensors or .bin weights).
    Raises ValueError naming the folder and what was looked for otherwise.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"init_from: {path} is not a directory")
    if (path / COMPLETE_FILE).is_file() or (path / STATE_FILE).is_file():
        return "training_checkpoint"
    if (path / CHECKPOINTS_DIR).is_dir():
        return "training_run"
    if (path / MCORE_MODEL_INFO_FILE).is_file():
        return "mcore_model"
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    if (path / "config.json").is_file() and has_weights:
        return "hf"
    raise ValueError(
        f"init_from: {path} is none of: a grpo-mega checkpoint ({COMPLETE_FILE}), a grpo-mega run directory "
        f"({CHECKPOINTS_DIR}/), a megatron model folder ({MCORE_MODEL_INFO_FILE}), a Hugging Face folder "
        "(config.json with *.safetensors or pytorch_model*.bin)"
    )


def list_files(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` as {relative POSIX path: size in bytes} (the listing of ``complete.json``)."""
    return {
        file.relative_to(folder).as_posix(): file.stat().st_size
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in the folder ``path`` durable (POSIX needs an fsync of the folder)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_file_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: readers see old or new, never half."""
    temporary = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


FULL_FRACTION = 0.01
"""A file system with less than this share of its size free (or under 1 MiB) counts as full."""


def _checkpoint_bytes(folder: Path) -> int:
    """The size of the complete checkpoint ``folder`` (its ``complete.json`` listing), 0 when unknown."""
    try:
        return sum(json.loads((folder / COMPLETE_FILE).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def full_disk_error(staging: Path, step: int, error: BaseException) -> OSError | None:
    """When the save of ``step`` into ``staging`` failed for want of space, an OSError(ENOSPC) that names the
    folder, the space left and the checkpoint ``latest`` still names; else None. Want of space: ENOSPC / EDQUOT in
    ``error``'s chain (torch's checkpoint writers do not always keep it; on the other ranks the error is only that a
    peer failed), or less free than the previous checkpoint took (what this save needs, about), 1 % of the file
    system or 1 MiB."""
    no_space = any(isinstance(link, OSError) and link.errno in NO_SPACE_ERRNOS for link in exception_chain(error))
    folder = staging.parent
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        usage = None
    latest = folder / LATEST_FILE
    previous = latest.read_text().strip() if latest.is_file() else None
    needed = _checkpoint_bytes(folder / previous) if previous else 0
    full = usage is not None and usage.free < max(FULL_FRACTION * usage.total, 2**20, needed)
    if not (no_space or full):
        return None
    space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB" if usage else "space unknown"
    if needed:
        space += f"; the previous checkpoint took {needed / 2**20:.1f} MiB"
    kept = f"the previous checkpoint {folder / previous} is untouched" if previous else "no earlier checkpoint exists"
    return OSError(errno.ENOSPC, f"the checkpoint of step {step} was not saved: no space left on the file system "
                                 f"of {staging} ({space}); {kept}")


def lora_settings(folder: str | os.PathLike) -> dict | None:
    """The ``lora`` entry of a training checkpoint's info (rank, alpha, target_modules, base), or None when the
    checkpoint holds a whole model."""
    return read_checkpoint_state(Path(folder)).get("lora")
