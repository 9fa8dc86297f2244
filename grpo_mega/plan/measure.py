"""Measure what a Megatron training engine really allocates on this machine, to check the planner against.

- Static bytes: the engine's own tensors, counted: the stage's parameters, megatron DDP's gradient buffers
  (``grad_data`` of every ``_ParamAndGradBuffer``), and the optimizer's state (Adam moments, and fp32 master copies
  where the parameters are bf16) after a step has created it.
- Activation peak: :class:`LiveBytes`, a ``TorchDispatchMode`` that sees every tensor an aten op returns (forward
  and backward) and keeps the sum of the storages still alive (each freed storage is subtracted by a weakref
  callback), with its maximum. Run over one call of megatron's forward-backward schedule (one micro-batch), it
  counts exactly what the micro-batch adds on top of the static bytes: saved activations, backward transients,
  the log-prob chunk buffers and the per-parameter gradients before DDP adds them to its buffer. Storages that
  existed before (parameters, buffers) are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive (``current``) and their maximum
    (``peak``); a storage is counted once however many views share it."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: that storage existed before (a parameter, a
        # buffer) or is already counted.
        inputs = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"}
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in inputs or (key in self._seen and self._seen[key]() is not None):
                continue
            nbytes = storage.nbytes()
            self._seen[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._free(k, n))
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return out


def engine_static_bytes(engine) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: bytes of the engine's parameters, DDP gradient buffers and optimizer state
    (after at least one step), counted from its tensors."""
    params = sum(p.numel() * p.element_size() for p in engine.stage.parameters())
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in engine.model.buffers)
    optimizer = 0
    for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = sub.optimizer
        for state in inner.state.values():
            optimizer += sum(v.numel() * v.element_size() for k, v in state.items()
                             if isinstance(v, torch.Tensor) and k != "step")
        for group in getattr(sub, "fp32_from_float16_groups", []):
            optimizer += sum(p.numel() * p.element_size() for p in group)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def measure_schedule_peak(engine) -> list[int]:
    """Make ``engine`` record, for each later call of its forward-backward schedule, the peak bytes that call
    allocated on top of what existed before (a list the caller reads after ``train_step``)."""
    peaks: list[int] = []
    run = engine._run_schedule

    def measured(micro_batches, loss_func_for, forward_only):
        with LiveBytes() as live:
            result = run(micro_batches, loss_func_for, forward_only)
        peaks.append(live.peak)
        return result

    engine._run_schedule = measured
    return peaks


def distributed_optimizer_bytes(engine) -> dict[str, int]:
    """{"params", "grads", "optimizer"} of this rank if ``engine``'s stage were wrapped with megatron's DDP for the
    distributed optimizer: megatron builds the buffers (``DistributedDataParallel`` with
    ``use_distributed_optimizer=True``) and partitions them over DP ranks
    (``DistributedOptimizer._build_gbuf_range_map``: the ranges its optimizer allocates master copies and moments
    for). Wraps the stage again: use the engine for
    nothing else afterwards."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ddp = DistributedDataParallel(
        config=engine.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=True),
        module=engine.stage)
    params = grads = optimizer = 0
    for buffer in ddp.buffers:
        params += buffer.param_data.numel() * buffer.param_data.element_size()
        grads += buffer.grad_data.numel() * buffer.grad_data.element_size()
        per_element = 8 + (4 if buffer.param_dtype != torch.float32 else 0)
        for ranges in DistributedOptimizer._build_gbuf_range_map(buffer).values():
            for bucket in ranges:
                optimizer += per_element * sum(r["param"].size for r in bucket["param_map"].values())
    return {"params": params, "grads": grads, "optimizer": optimizer}
