"""Hugging Face checkpoint folders: read weights lazily, write them shard by shard, copy side files.

Only the safetensors format is read and written (what `save_pretrained` writes by default): a single
`model.safetensors`, or `model-0000i-of-0000N.safetensors` files with `model.safetensors.index.json`.
Reading is lazy so that each rank of a parallel job loads only the tensors of its pipeline stage;
writing streams, so exporting a model holds at most one shard in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
_WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")
# save_pretrained's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class HFWeights(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint folder as a read-only mapping name -> tensor, read on access.

    Raises ValueError when the folder has no safetensors weights (naming the folder) and KeyError
    naming the tensor and the folder when a name is absent.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE_FILE).is_file():
            with safe_open(self.folder / SINGLE_FILE, framework="pt") as handle:
                self._file_of = {name: self.folder / SINGLE_FILE for name in handle.keys()}
        else:
            raise ValueError(
                f"{self.folder} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); "
                "re-save the model with save_pretrained(..., safe_serialization=True)"
            )
        missing = sorted({str(path) for path in self._file_of.values() if not path.is_file()})
        if missing:
            raise ValueError(f"{index} names weight file(s) that do not exist: {missing}")
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is not in the HF checkpoint {self.folder}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor from the file header, without reading its data."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def __contains__(self, name: object) -> bool:
        return name in self._file_of  # without reading the tensor, unlike Mapping's default

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


class SafetensorsShardWriter:
    """Write named tensors into size-capped safetensors shards plus the index `from_pretrained` reads.

    Tensors are copied to the CPU as they are added; a shard is written as soon as adding the next
    tensor would pass `max_shard_bytes`, so peak memory is one shard. `close()` names the files like
    `save_pretrained` does (`model.safetensors` when there is one shard).
    """

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        existing = sorted(p.name for p in self.folder.glob("*.safetensors*"))
        if existing:
            raise ValueError(f"{self.folder} already holds safetensors files {existing[:4]}; "
                             "write into an empty folder so shards of two models cannot mix")
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (copied to contiguous CPU memory); flush the shard when it is full."""
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} was added twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.folder / f"model-part-{len(self._written) + 1:05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give the shards their final names, write the index; return the files."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            final = self.folder / SINGLE_FILE
            self._written[0][0].rename(final)
            return [final]
        weight_map, files = {}, []
        for number, (path, names) in enumerate(self._written, start=1):
            final = self.folder / f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        return files


def copy_side_files(source: str | os.PathLike, target: str | os.PathLike) -> list[str]:
    """Copy everything of an HF folder except the weights (config, tokenizer, generation config...).

    Returns the names copied. Sub-folders are left out: HF model folders keep those files at the top.
    """
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES) or path.name in _WEIGHT_INDEXES:
            continue
        shutil.copy2(path, target / path.name)
        copied.append(path.name)
    return copied
