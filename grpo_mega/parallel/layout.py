"""How the processes of a run split a model: tensor (TP), pipeline (PP), data (DP) parallel sizes.

Megatron orders ranks tp-cp-ep-dp-pp: the TP group is the fastest-varying index, PP the slowest.
This module only checks sizes; `grpo_mega.parallel.distributed` creates the process groups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three parallel dimensions; world_size = tp * pp * dp."""

    tp: int
    """Tensor parallel size: each weight matrix is split across this many ranks."""
    pp: int
    """Pipeline parallel size: the layers are split into this many consecutive stages."""
    dp: int
    """Data parallel size: this many model replicas see different micro-batches."""
    ep: int = 1
    """Expert parallel size (mixture-of-experts models): each MoE layer's experts are split over this many of the
    tp * dp ranks of a pipeline stage, each expert whole on one rank; 1 for a dense model."""

    @property
    def world_size(self) -> int:
        """Number of processes the layout needs: tp * pp * dp."""
        return self.tp * self.pp * self.dp


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def layout_for_world(tp: int, pp: int, world_size: int, *, ep: int = 1) -> ParallelLayout:
    """Return the layout with dp = world_size / (tp * pp).

    Raises ValueError naming the setting when a size is not positive, when world_size is not a
    multiple of tp * pp, or when the expert-parallel size ``ep`` does not divide a stage's ranks or is not a
    multiple of ``tp`` (the experts of a stage are split over whole tensor-parallel groups, each expert whole).
    """
    _check_positive("tensor_parallel", tp)
    _check_positive("pipeline_parallel", pp)
    _check_positive("expert_parallel", ep)
    _check_positive("world_size", world_size)
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world_size {world_size} is not a multiple of tp*pp={tp * pp} "
            f"(tensor_parallel={tp}, pipeline_parallel={pp})"
        )
    per_stage = world_size // pp
    if per_stage % ep != 0:
        raise ValueError(f"expert_parallel={ep} does not divide the {per_stage} ranks of a pipeline stage "
                         f"(world_size {world_size} / pipeline_parallel={pp})")
    if ep > 1 and ep % tp != 0:
        raise ValueError(
            f"expert_parallel={ep} must be a multiple of tensor_parallel={tp}: the experts are split over whole "
            f"tensor-parallel groups (with fewer expert ranks than TP ranks the experts' gradients do not match a "
            f"TP=1 step's)")
    return ParallelLayout(tp=tp, pp=pp, dp=world_size // (tp * pp), ep=ep)


def validate_model_split(
    tp: int, pp: int, num_layers: int, num_attention_heads: int, num_query_groups: int
) -> None:
    """Check that a model splits evenly into TP shards and PP stages.

    Requirements (each failure raises ValueError naming the setting): tp divides
    num_attention_heads and num_query_groups (every rank holds whole heads and whole key/value
    groups); pp <= num_layers (no empty stage) and pp divides num_layers (megatron-core splits
    layers evenly unless given an explicit layout).
    """
    _check_positive("tensor_parallel", tp)
    _check_positive("pipeline_parallel", pp)
    _check_positive("num_layers", num_layers)
    _check_positive("num_attention_heads", num_attention_heads)
    _check_positive("num_query_groups", num_query_groups)
    if num_attention_heads % tp != 0:
        raise ValueError(
            f"tensor_parallel={tp} does not divide num_attention_heads={num_attention_heads}"
        )
    if num_query_groups % tp != 0:
        raise ValueError(
            f"tensor_parallel={tp} does not divide num_query_groups={num_query_groups} "
            "(num_key_value_heads)"
        )
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel={pp} exceeds num_layers={num_layers}")
    if num_layers % pp != 0:
        raise ValueError(f"pipeline_parallel={pp} does not divide num_layers={num_layers}")


def validate_layout(
    tp: int,
    pp: int,
    world_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
) -> ParallelLayout:
    """Check that a TP x PP layout fits the world size and the model; return the layout.

    world_size must be a multiple of tp * pp (`layout_for_world`) and the model must split evenly
    (`validate_model_split`); a failure raises ValueError naming the setting.
    """
    layout = layout_for_world(tp, pp, world_size)
    validate_model_split(tp, pp, num_layers, num_attention_heads, num_query_groups)
    return layout
