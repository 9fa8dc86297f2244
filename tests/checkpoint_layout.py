"""Where megatron-core's dist_checkpointing (torch_dist format) puts the parts of a checkpoint, for tests that alter or
delete one. The common (non-sharded) state is its own file, ``common.pt``, up to megatron-core 0.16; from 0.19 it is
a ShardedObject ``common_state`` stored inside the ``.distcp`` shards (megatron/core/dist_checkpointing/
serialization.py: ``save`` adds it, ``load_common_state_dict`` still reads a legacy ``common.pt`` first)."""

from __future__ import annotations

from pathlib import Path

LEGACY_COMMON_FILE = "common.pt"


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
