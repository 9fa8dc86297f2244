"""One LoRA adapter beside one of megatron-core's tensor-parallel linears, sharded as that linear is.

The adapted layer computes y = x W^T + s * dropout(x) A^T B^T, s = alpha / rank, with W frozen. Under tensor
parallelism (TP ranks t = 1..T), as Megatron-Bridge's ``ParallelLinearAdapter`` shards it:

- column-parallel W (rows = output features split over T; ``linear_qkv``, ``linear_fc1``): A (rank x in) is whole
  on every rank, B (out/T x rank) is split like W's rows. h = x A^T is the same on every rank; each rank adds its
  own output features h B_t^T. Backward: dL/dh = sum_t dL/dy_t B_t is all-reduced over TP (``copy_to_...``), so
  A's gradient is whole and equal on every rank. With sequence parallelism x arrives split along the sequence and
  is all-gathered first (its gradient split back, not reduced: dL/dx is already whole on every rank).
- row-parallel W (columns = input features split over T; ``linear_proj``, ``linear_fc2``): A (rank x in/T) is split
  like W's columns, B (out x rank) is whole. h = sum_t x_t A_t^T is all-reduced over TP (a rank-wide vector per
  token, cheap), then h B^T is added to the base's reduced output; with sequence parallelism that output is split
  along the sequence, and so is the adapter's (its gradient all-gathered back).

Every identity is exact: at any TP the adapted layer computes the same function and A, B receive the same
gradients as at TP 1 (up to the order of floating-point sums). The merged weight W + s * B A is formed shard by
shard with no communication (``delta``): a column shard is B_t A, a row shard B A_t.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)


def parallel_kind(base: torch.nn.Module) -> str:
    """``column`` or ``row``: how ``base`` (a megatron-core parallel linear) splits its weight over TP ranks."""
    if isinstance(base, ColumnParallelLinear):
        return "column"
    if isinstance(base, RowParallelLinear):
        return "row"
    raise TypeError(f"LoRA adapts megatron-core's ColumnParallelLinear / RowParallelLinear, not {type(base).__name__}")


def initial_a(rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The whole A (rank x in_features), uniform in +-1/sqrt(in_features) (peft's kaiming_uniform(a=sqrt(5))), drawn
    from its own generator: the same A at every TP / PP layout, and the job's random streams are not touched."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)


class LoRAAdapter(torch.nn.Module):
    """The adapter of ``base``: parameters ``A`` and ``B`` (B zero at the start), this rank's shards.

    Args:
        base: the frozen megatron-core ColumnParallelLinear / RowParallelLinear it adapts.
        rank, alpha, dropout: ``model.lora``'s.
        seed: seed of A's initial values (one per adapted layer).
    """

    def __init__(self, base: torch.nn.Module, *, rank: int, alpha: float, dropout: float, seed: int):
        super().__init__()
        self.kind = parallel_kind(base)
        self.scale = alpha / rank
        self.dropout = dropout
        self.sequence_parallel = bool(base.sequence_parallel)
        weight = base.weight
        tp_rank = mpu.get_tensor_model_parallel_rank()
        a = initial_a(rank, base.input_size, seed)
        if self.kind == "row":
            width = base.input_size_per_partition
            a = a[:, tp_rank * width:(tp_rank + 1) * width]
            b = torch.zeros(base.output_size, rank)
        else:
            b = torch.zeros(base.output_size_per_partition, rank)
        self.A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.B = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype))
        # Sharded parameters count once per TP rank in megatron's gradient norm, whole ones on TP rank 0 only.
        set_tensor_model_parallel_attributes(self.A, self.kind == "row", 1 if self.kind == "row" else -1, 1)
        set_tensor_model_parallel_attributes(self.B, self.kind == "column", 0 if self.kind == "column" else -1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """s * dropout(x) A^T B^T for the base's input ``x`` ([S, B, in] or this rank's part of it), shaped as
        the base's output on this rank."""
        if self.kind == "column":
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            x = self._drop(x, per_tp_rank=False)
            h = copy_to_tensor_model_parallel_region(F.linear(x, self.A))
            return F.linear(h, self.B) * self.scale
        h = reduce_from_tensor_model_parallel_region(F.linear(self._drop(x, per_tp_rank=True), self.A))
        out = F.linear(h, self.B) * self.scale
        return scatter_to_sequence_parallel_region(out) if self.sequence_parallel else out

    def _drop(self, x: torch.Tensor, *, per_tp_rank: bool) -> torch.Tensor:
        """Dropout while training. Whole inputs (column) draw one mask on every TP rank from the shared stream, so
        A's replicas see the same input; split inputs (row) draw from megatron's per-TP-rank stream."""
        if not (self.training and self.dropout > 0.0):
            return x
        if per_tp_rank:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout, training=True)
        return F.dropout(x, self.dropout, training=True)

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """s * B A on this rank, in fp32: the update of this rank's shard of the base weight."""
        return (self.B.float() @ self.A.float()) * self.scale
