"""Bytes a training rank holds for its whole life: parameters, the DDP gradient buffers and the optimizer state,
as the engine allocates them (``grpo_mega.engine.megatron_engine``):

- megatron's ``DistributedDataParallel`` with ``grad_reduce_in_fp32=True`` and ``overlap_grad_reduce=False``: one
  contiguous fp32 gradient buffer per parameter dtype (``_ParamAndGradBuffer``), one bucket; with the distributed
  optimizer each parameter starts at a multiple of 64 elements, the buffer is padded to lcm(DP, 128) and the
  last stage's copy of tied embeddings gets a bucket of its own, and the parameters move into a param buffer of the
  same (padded) length in their dtype;
- megatron's optimizer (Adam): bf16 parameters get an fp32 master copy (``Float16OptimizerWithFloat16Params``),
  fp32 parameters are stepped in place; two fp32 moments (``exp_avg``, ``exp_avg_sq``) per element. With the
  distributed optimizer each DP rank keeps master copies and moments for its 1/DP slice of each bucket only.
  Adam's step counters (one scalar per tensor, on the host) are not counted.

The layout rules are megatron-core 0.16's (``distributed/param_and_grad_buffer.py``); the CPU tests check the
result against the tensors the engine really allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_mega.plan.counts import DTYPE_BYTES, ParamInfo

GRAD_BYTES = 4  # grad_reduce_in_fp32=True
MOMENT_BYTES = 8  # Adam exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master copy of a bf16 / fp16 parameter


@dataclass(frozen=True)
class BufferLayout:
    """One DDP buffer: its parameters' (start, end) element ranges, its buckets' (start, end), its length."""

    dtype: str
    ranges: tuple[tuple[int, int], ...]
    buckets: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0


def buffer_layouts(params: list[ParamInfo], data_parallel: int, distributed_optimizer: bool) -> list[BufferLayout]:
    """The gradient buffers megatron's DDP builds for ``params`` (trainable, in ``named_parameters`` order), with
    one bucket per buffer (``overlap_grad_reduce=False``), following ``_ParamAndGradBuffer.__init__``."""
    layouts = []
    for dtype in dict.fromkeys(p.dtype for p in params):  # buffers in order of first appearance, as DDP does
        members = [p for p in params if p.dtype == dtype][::-1]  # reverse order: roughly the backward order
        divisor = math.lcm(data_parallel, 128)
        ranges, buckets = [], []
        bucket_start = start = 0
        open_bucket = False
        for param in members:
            if distributed_optimizer:
                start = math.ceil(start / 64) * 64
            own_bucket = param.shared_embedding and distributed_optimizer
            if own_bucket and open_bucket:
                end = math.ceil(start / divisor) * divisor
                buckets.append((bucket_start, end))
                bucket_start = start = end
            ranges.append((start, start + param.numel))
            start += param.numel
            open_bucket = True
            if own_bucket:
                end = math.ceil(start / divisor) * divisor
                buckets.append((bucket_start, end))
                bucket_start = start = end
                open_bucket = False
        if open_bucket:
            end = math.ceil(start / divisor) * divisor if distributed_optimizer else start
            buckets.append((bucket_start, end))
        layouts.append(BufferLayout(dtype, tuple(ranges[::-1]), tuple(buckets)))
    return layouts


@dataclass(frozen=True)
class StaticBytes:
    """What one training rank allocates for its model, gradients and optimizer (bytes)."""

    params: int
    grads: int
    optimizer: int
    """fp32 master copies + Adam moments."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _shard_elements(layout: BufferLayout, data_parallel: int, dp_rank: int) -> int:
    """Parameter elements (padding excluded) in DP rank ``dp_rank``'s slice of every bucket of ``layout``."""
    total = 0
    for bucket_start, bucket_end in layout.buckets:
        size = (bucket_end - bucket_start) // data_parallel
        lo, hi = bucket_start + dp_rank * size, bucket_start + (dp_rank + 1) * size
        total += sum(max(0, min(end, hi) - max(start, lo)) for start, end in layout.ranges)
    return total


def training_static_bytes(params: list[ParamInfo], data_parallel: int, distributed_optimizer: bool) -> StaticBytes:
    """Static bytes of the most loaded DP rank of a stage whose parameters are ``params``. Frozen ones (a LoRA
    policy's base) hold their weights only: no gradient buffer, no optimizer state, outside DDP's param buffer."""
    frozen = sum(p.bytes for p in params if not p.trainable)
    params = [p for p in params if p.trainable]
    layouts = buffer_layouts(params, data_parallel, distributed_optimizer)
    grads = sum(layout.numel for layout in layouts) * GRAD_BYTES
    if not distributed_optimizer:
        weights = frozen + sum(p.bytes for p in params)
        optimizer = sum(p.numel * (MOMENT_BYTES + (MASTER_BYTES if DTYPE_BYTES[p.dtype] < 4 else 0)) for p in params)
        return StaticBytes(weights, grads, optimizer)
    weights = frozen + sum(layout.numel * DTYPE_BYTES[layout.dtype] for layout in layouts)
    optimizer = max(
        sum(_shard_elements(layout, data_parallel, rank)
            * (MOMENT_BYTES + (MASTER_BYTES if DTYPE_BYTES[layout.dtype] < 4 else 0)) for layout in layouts)
        for rank in range(data_parallel))
    return StaticBytes(weights, grads, optimizer)


def forward_only_bytes(params: list[ParamInfo]) -> int:
    """A forward-only engine (reference, PRM) holds its parameters and nothing else."""
    return sum(p.bytes for p in params)


@dataclass(frozen=True)
class SaveBytes:
    """What a checkpoint save adds on one rank (bytes): ``device`` on the GPU while it runs, ``host`` in host RAM."""

    device: int
    host: int


def checkpoint_save_bytes(params: list[ParamInfo], data_parallel: int, distributed_optimizer: bool) -> SaveBytes:
    """A training checkpoint save of a stage whose trainable parameters are ``params`` (megatron-core 0.16,
    ``grpo_mega.checkpoint.training``).

    With the distributed optimizer its state is saved in ``fully_reshardable`` form
    (``DistributedOptimizer.get_parameter_state_dp_zero`` with ``return_on_all_ranks``): for each bucket and each
    of the master weights and the two moments in turn, the rank's fp32 slice goes to the GPU and is all-gathered
    over DP into DP GPU tensors of the slice's size (the whole bucket), which are then copied into host tensors of
    the whole model-parallel shard, on every DP rank. So the GPU holds one bucket's fp32 slice and its gathered
    copies at a time, and host RAM the three fp32 tensors of every parameter of the stage, plus the bucket being
    concatenated. Without it each rank's state tensors are written from where they are; the writer stages on the
    host what the rank writes (at most its parameters, master weights and moments). A LoRA policy saves its
    adapters alone: only trainable parameters count."""
    params = [p for p in params if p.trainable]
    if distributed_optimizer:
        layouts = buffer_layouts(params, data_parallel, distributed_optimizer)
        largest_bucket = max((end - start for layout in layouts for start, end in layout.buckets), default=0)
        elements = sum(layout.numel for layout in layouts)
        device = (largest_bucket + largest_bucket // data_parallel) * 4
        return SaveBytes(device=device, host=3 * 4 * elements + 4 * largest_bucket)
    static = training_static_bytes(params, data_parallel, distributed_optimizer)
    return SaveBytes(device=0, host=static.params + static.optimizer)
