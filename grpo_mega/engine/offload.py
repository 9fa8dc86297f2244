"""Give a training engine's gradient buffers and optimizer state up during rollout, and take them back for the
update (``parallel.offload_during_rollout``): on a GPU shared with vLLM they are the largest tenants that
generation does not need (at 7B in fp32 Adam: ~28 GiB of moments, ~14-28 GiB of gradient buffer per replica).

The move works on tensor *storages*, not tensor objects: a storage is resized to 0 bytes (its device memory goes
back to the allocator) and later resized to its old size and refilled. Every tensor object stays the same, so
everything that points at it keeps working: megatron's ``param.main_grad`` views into the DDP gradient buffer, the
optimizer's ``param_groups`` and ``state`` dicts, the fp32 master copies of bf16 training. This is how verl offloads
megatron's buffers; the moves are exact (bytes copied, nothing converted), so a run with the offload computes
exactly what a run without it computes.

Two kinds of content:

- kept (optimizer moments, fp32 master copies): copied to host memory (pinned on CUDA, for fast copies back),
  then released; restored byte for byte;
- discarded (gradient buffers): released without a copy, and zero-filled when taken back. The engine zeroes its
  gradient buffer at the start of every optimizer step anyway, and nothing reads it between steps.

On the CPU the "host" is the same memory, so the copy only costs; the option is meant for GPUs, and the CPU tests
use it to check that the tensors really leave and come back bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class _Released:
    storage: torch.UntypedStorage
    nbytes: int
    host_copy: torch.Tensor | None
    """uint8 copy of the whole storage in host memory; None for discarded content (zero-filled on restore)."""


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage`` (to copy a storage whatever the tensors on it look like)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (views of one buffer count once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


class StorageOffload:
    """Releases the storages of groups of tensors and brings them back; one offload at a time."""

    def __init__(self):
        self._released: list[_Released] = []

    @property
    def active(self) -> bool:
        """True between :meth:`offload` and :meth:`restore`."""
        return bool(self._released)

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory for the kept content."""
        return sum(r.host_copy.numel() for r in self._released if r.host_copy is not None)

    @property
    def released_bytes(self) -> int:
        """Device bytes given back by the current offload."""
        return sum(r.nbytes for r in self._released)

    def offload(self, *, keep: Iterable[torch.Tensor], discard: Iterable[torch.Tensor]) -> int:
        """Copy the storages under ``keep`` to host memory and release them; release the storages under
        ``discard`` without a copy. Returns the device bytes released. RuntimeError when already offloaded."""
        if self.active:
            raise RuntimeError("offload: the tensors are already offloaded (restore() first)")
        kept = unique_storages(keep)
        kept_ptrs = {s.data_ptr() for s in kept}
        discarded = [s for s in unique_storages(discard) if s.data_ptr() not in kept_ptrs]
        released = []
        for storage in kept:
            source = _bytes_view(storage)
            host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=source.is_cuda)
            host.copy_(source)
            released.append(_Released(storage, storage.nbytes(), host))
        released += [_Released(storage, storage.nbytes(), None) for storage in discarded]
        if any(r.host_copy is not None and r.host_copy.is_pinned() for r in released):
            torch.cuda.synchronize()  # the pinned copies must be complete before the device memory goes
        for record in released:
            record.storage.resize_(0)
        self._released = released
        return self.released_bytes

    def restore(self) -> int:
        """Give every released storage its size back and refill it (kept: the host copy; discarded: zeros);
        returns the device bytes restored (0 when nothing was offloaded)."""
        restored = self.released_bytes
        for record in self._released:
            record.storage.resize_(record.nbytes)
            target = _bytes_view(record.storage)
            if record.host_copy is None:
                target.zero_()
            else:
                target.copy_(record.host_copy, non_blocking=record.host_copy.is_pinned())
        self._released = []
        return restored


def megatron_optimizer_state(optimizer, model_parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a megatron optimizer (chained or not) that only the optimizer step needs: every tensor in
    its torch optimizers' ``state`` (Adam moments, step counts) and the parameters it updates that are not the
    model's own (the fp32 master copies of bf16 training)."""
    model = {p.untyped_storage().data_ptr() for p in model_parameters}
    tensors = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:  # a stub optimizer of a rank without parameters
            continue
        for state in inner.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        for group in inner.param_groups:
            tensors += [p for p in group["params"] if p.untyped_storage().data_ptr() not in model]
    return tensors


def megatron_grad_buffers(ddp_model) -> list[torch.Tensor]:
    """The gradient buffers of a megatron DistributedDataParallel model (``main_grad`` of every parameter is a
    view into one of them)."""
    buffers = list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))
    grads = []
    for buffer in buffers:
        if buffer.grad_data is None:
            continue
        param_data = getattr(buffer, "param_data", None)
        grad_storage = buffer.grad_data.untyped_storage().data_ptr()
        if param_data is not None and param_data.untyped_storage().data_ptr() == grad_storage:
            raise RuntimeError("offload: this DDP buffer keeps parameters and gradients in one storage "
                               "(megatron's shared param/grad buffer); its gradients cannot be released alone")
        grads.append(buffer.grad_data)
    return grads


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (0 for released ones)."""
    return sum(storage.nbytes() for storage in unique_storages(tensors))
