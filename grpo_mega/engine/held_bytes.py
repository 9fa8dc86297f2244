"""What a rank holds, counted by tensor storage (each storage once: views share one): the one count behind the
Megatron engine's and the DeepSpeed engine's memory figures (``engine.distributed_optimizer.static_memory_bytes``,
``engine.deepspeed_figures.static_memory_bytes``). Torch only."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """{storage address: bytes} of the tensors' storages, each storage once; None and empty storages skipped."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            found[storage.data_ptr()] = storage.nbytes()
    return found


def torch_optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors a torch optimizer holds: the parameters it updates (fp32 master copies or shards of them, where
    megatron or ZeRO keep those) and its per-parameter state (Adam's moments and step counts)."""
    tensors = [param for group in optimizer.param_groups for param in group["params"]]
    for state in optimizer.state.values():
        tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return tensors
