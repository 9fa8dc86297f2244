"""Where megatron-core's dist_checkpointing (torch_dist format) puts the parts of a checkpoint, for tests that alter or
delete one. The common (non-sharded) state is its own file, ``common.pt``, up to megatron-core 0.16; from 0.19 it is
a ShardedObject ``common_state`` stored inside the ``.distcp`` shards (megatron/core/dist_checkpointing/
serialization.py: ``save`` adds it, ``load_common_state_dict`` still reads a legacy ``common.pt`` first)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from grpo_mega.run.layout import (CHECKPOINTS_DIR, COMPLETE_FILE, CONFIG_FILE, LATEST_FILE, STATE_FILE,
                                  step_dir_name)

LEGACY_COMMON_FILE = "common.pt"


def write_published_checkpoint(run_dir: Path, step: int, *, state: dict, config_yaml: str) -> Path:
    """A complete checkpoint folder of ``run_dir`` as the checkpoint manager publishes it, written by hand: its
    marker (``state`` as grpo_mega_checkpoint.json), ``config_yaml`` as its config, placeholder shards, then
    complete.json with every file's size and CRC-32, and ``latest`` naming it. For tests of the readers of a run
    folder that need no trained weights."""
    folder = run_dir / CHECKPOINTS_DIR / step_dir_name(step)
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps(state) + "\n")
    (folder / CONFIG_FILE).write_text(config_yaml)
    (folder / "metadata.json").write_text("{}\n")
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    checksums = {name: f"{zlib.crc32((folder / name).read_bytes()):08x}" for name in files}
    (folder / COMPLETE_FILE).write_text(json.dumps({
        "format": "grpo_mega.training_checkpoint", "version": 1, "step": step, "files": files,
        "checksum_algorithm": "crc32", "checksums": checksums}))
    (run_dir / CHECKPOINTS_DIR / LATEST_FILE).write_text(folder.name + "\n")
    return folder


def data_ranges(checkpoint: Path, prefix: str) -> list[tuple[str, int, int]]:
    """(file, offset, length) of the stored items whose key starts with ``prefix``, from the shards' metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    return sorted({(info.relative_path, info.offset, info.length) for index, info in metadata.storage_data.items()
                   if index.fqn.startswith(prefix)})


def common_state_range(checkpoint: Path) -> tuple[str, int, int]:
    """(file, offset, length) of the checkpoint's common state: all of ``common.pt`` where the installed
    megatron-core wrote one, else the ``common_state`` item of a shard."""
    legacy = checkpoint / LEGACY_COMMON_FILE
    if legacy.exists():
        return LEGACY_COMMON_FILE, 0, legacy.stat().st_size
    found = data_ranges(checkpoint, "common_state")
    assert len(found) == 1, f"{checkpoint}: no common.pt and {len(found)} stored common_state items"
    return found[0]
