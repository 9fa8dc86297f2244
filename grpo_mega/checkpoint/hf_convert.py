"""HF <-> megatron-core weights of a model split over tensor (TP) and pipeline (PP) parallel ranks.

- `hf_to_mcore_shards`: the megatron state dict of one (TP rank, PP rank) from HF tensors; a running
  job calls `load_hf_weights` to put HF weights straight into its model at any TP/PP.
- `export_hf_weights`: run collectively by every rank of a running job, yields (HF name, full tensor)
  one at a time: TP shards are all-gathered over the TP group, and the stage owning a tensor broadcasts
  it over the PP group, so every rank sees every tensor and peak memory is one full tensor. The weight
  sync to the rollout engine and the mcore -> HF tool both use it.
- `mcore_shards_to_hf`: the same inverse without processes, from the state dicts of all ranks.

All layouts and names come from the tables in `grpo_mega.checkpoint.hf_layouts`: causal LMs (Qwen2,
Llama, Qwen3, Qwen3-MoE) and the classifier PRM (Qwen2ForProcessRewardModel, whose head is part of its table).
An MoE model's experts are split over the expert-parallel (EP) ranks, each expert whole: its rows are read by
the rank's EP rank instead of its TP rank, and gathered over the EP group on export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from grpo_mega.checkpoint.hf_io import HFWeights
from grpo_mega.checkpoint.hf_layouts import (
    ArchitectureTable,
    StageRow,
    architecture_for,
    model_tensor_name,
    stage_layers,
    stage_rows,
)
from grpo_mega.checkpoint.hf_transforms import ModelDims, read_model_dims
from grpo_mega.model.config_map import padded_vocab_size as default_padded_vocab_size
from grpo_mega.parallel.layout import validate_model_split

# Non-persistent buffers some older HF checkpoints still carry; recomputed from the config.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _layout_rank(row: StageRow, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(rank, size) a row's layout splits over: an expert is whole on its rank, everything else splits over TP."""
    return (0, 1) if row.per_expert else (tp_rank, tp_size)


def _all_rows(hf_config: Any, dims: ModelDims, pp_size: int) -> list[StageRow]:
    table = architecture_for(hf_config)
    return [
        row
        for pp_rank in range(pp_size)
        for row in stage_rows(
            table, hf_config, dims, stage_layers(dims.num_layers, pp_rank, pp_size),
            pp_rank == 0, pp_rank == pp_size - 1,
        )
    ]


def _shape_mismatch(name: str, actual: tuple, expected: tuple, dims: ModelDims) -> ValueError:
    return ValueError(
        f"HF tensor {name!r} has shape {tuple(actual)} but the config implies {tuple(expected)} "
        f"(hidden_size={dims.hidden_size}, num_attention_heads={dims.num_attention_heads}, "
        f"num_key_value_heads={dims.num_query_groups}, head_dim={dims.head_dim}, "
        f"intermediate_size={dims.ffn_hidden_size}, vocab_size={dims.vocab_size})"
    )


def check_hf_weights(hf_weights: Mapping[str, torch.Tensor], hf_config: Any, dims: ModelDims) -> None:
    """Check that HF weights have exactly the tensors, and shapes, that the config implies.

    Raises ValueError listing missing tensors (e.g. a bias the config asks for) and tensors the table
    does not know (e.g. biases the config says are absent), or naming the first tensor whose shape
    the config contradicts. A separate lm_head.weight is tolerated with tied embeddings
    (transformers' state_dict lists it); rotary inv_freq buffers are ignored. With `HFWeights`,
    shapes come from the file headers: no tensor is read.
    """
    rows = _all_rows(hf_config, dims, 1)
    expected = {name: shape for row in rows for name, shape in zip(row.hf, row.shapes)}
    present = {name for name in hf_weights if not name.endswith(_IGNORED_HF_SUFFIXES)}
    if dims.tie_word_embeddings:
        present.discard("lm_head.weight")
    missing, unknown = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or unknown:
        model_type = architecture_for(hf_config).label
        problems = []
        if missing:
            problems.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unknown:
            problems.append(f"not in the {model_type} table {unknown[:8]}")
        raise ValueError(f"HF weights do not match the {model_type} config: " + "; ".join(problems))
    for name, shape in expected.items():
        actual = (hf_weights.shape_of(name) if isinstance(hf_weights, HFWeights)
                  else tuple(hf_weights[name].shape))
        if tuple(actual) != shape:
            raise _shape_mismatch(name, actual, shape, dims)


def _fetch(hf_weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...],
           dims: ModelDims) -> torch.Tensor:
    tensor = hf_weights[name]
    if tuple(tensor.shape) != shape:
        raise _shape_mismatch(name, tensor.shape, shape, dims)
    return tensor


def iter_mcore_shards(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    *,
    padded_vocab_size: int | None = None,
    layers: Sequence[int] | None = None,
    exclude_prefixes: tuple[str, ...] = (),
    ep_rank: int = 0,
    ep_size: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_to_mcore_shards` one tensor at a time: (megatron name, shard), reading HF tensors lazily.

    All checks (architecture, layout, tensor names and shapes) run before the first tensor is read.
    Rows whose megatron name starts with one of `exclude_prefixes` are neither read nor yielded.
    """
    architecture_for(hf_config)  # unsupported model_type fails before anything else
    dims = read_model_dims(
        hf_config, padded_vocab_size or default_padded_vocab_size(hf_config.vocab_size, tp_size)
    )
    validate_model_split(tp_size, pp_size, dims.num_layers, dims.num_attention_heads,
                         dims.num_query_groups)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor rank {tp_rank} is outside tensor_parallel={tp_size}")
    check_hf_weights(hf_state_dict, hf_config, dims)
    if layers is None:
        layers = stage_layers(dims.num_layers, pp_rank, pp_size)
    rows = stage_rows(architecture_for(hf_config), hf_config, dims, layers,
                      pp_rank == 0, pp_rank == pp_size - 1, ep_rank, ep_size)
    for row in rows:
        if row.mcore.startswith(exclude_prefixes):  # startswith(()) is False
            continue
        tensors = [_fetch(hf_state_dict, name, shape, dims) for name, shape in zip(row.hf, row.shapes)]
        yield row.mcore, row.layout.to_mcore(tensors, dims, *_layout_rank(row, tp_rank, tp_size))


def hf_to_mcore_shards(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    *,
    padded_vocab_size: int | None = None,
    layers: Sequence[int] | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The megatron-core state dict (GPTModel names, local spec) of TP rank `tp_rank`, PP stage `pp_rank` (and, for
    an MoE model, expert-parallel rank `ep_rank` of `ep_size`: the experts it holds).

    `hf_state_dict` maps HF names to tensors; a lazy mapping (`HFWeights`) reads only this stage's
    tensors. `padded_vocab_size` defaults to `grpo_mega.model.config_map.padded_vocab_size`; `layers`
    (global indices of the stage's layers) defaults to megatron's even split. Returned tensors are
    new tensors (copies of the needed parts), in the HF dtype. Raises ValueError for an architecture without a
    table, a layout the model cannot split (names the setting), and a tensor that is missing or whose
    shape the config contradicts (names the tensor and both shapes).
    """
    return dict(iter_mcore_shards(hf_state_dict, hf_config, tp_rank, tp_size, pp_rank, pp_size,
                                  padded_vocab_size=padded_vocab_size, layers=layers, ep_rank=ep_rank,
                                  ep_size=ep_size))


def mcore_shards_to_hf(
    shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]],
    hf_config: Any,
    tp_size: int,
    pp_size: int,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Full HF tensors from the megatron state dicts of every rank, keyed (tp_rank, pp_rank), or (tp_rank,
    pp_rank, ep_rank) for an MoE model split over `ep_size` expert-parallel ranks.

    The inverse of `hf_to_mcore_shards` over all ranks (layers split evenly over stages). Raises
    ValueError naming the rank and tensor when a shard is missing.
    """
    dims = read_model_dims(hf_config, hf_config.vocab_size)  # to_hf does not need the padding
    table = architecture_for(hf_config)
    by_rank = {(key[0], key[1], key[2] if len(key) > 2 else 0): state for key, state in shards.items()}

    def shard(tp_rank: int | None, pp_rank: int, ep_rank: int | None, name: str) -> torch.Tensor:
        # None: a rank coordinate the row does not depend on (experts: TP; the rest: EP), any rank that has it
        if tp_rank is None:
            tp_rank = min((t for t, p, e in by_rank if (p, e) == (pp_rank, ep_rank)), default=0)
        if ep_rank is None:
            ep_rank = min((e for t, p, e in by_rank if (t, p) == (tp_rank, pp_rank)), default=0)
        rank_state = by_rank.get((tp_rank, pp_rank, ep_rank))
        if rank_state is None or name not in rank_state:
            raise ValueError(f"megatron shard {name!r} of tp_rank={tp_rank}, pp_rank={pp_rank}"
                             f"{f', ep_rank={ep_rank}' if ep_size > 1 else ''} is missing")
        return rank_state[name]

    full: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        layers = stage_layers(dims.num_layers, pp_rank, pp_size)
        for row in stage_rows(table, hf_config, dims, layers, pp_rank == 0, pp_rank == pp_size - 1, 0, ep_size):
            if not row.exported:
                continue
            if row.per_expert:
                for ep_rank, names in enumerate(row.hf_by_ep_rank):
                    full.update(zip(names, row.layout.to_hf([shard(None, pp_rank, ep_rank, row.mcore)], dims)))
                continue
            parts = [shard(tp_rank, pp_rank, None, row.mcore)
                     for tp_rank in range(tp_size if row.layout.split else 1)]
            full.update(zip(row.hf, row.layout.to_hf(parts, dims)))
    return full


# ----------------------------------------------------------------------------------------------
# A running model


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def _model_tensors(gpt: torch.nn.Module, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers under `prefixes` (a table's `model_prefixes`), by name,
    without `_extra_state` placeholders.

    For a causal LM's table, heads attached to the backbone (the engine's `head` submodule, e.g. a PRM
    scorer) are not HF weights and are left out; everything under the table's prefixes must match a row.
    """
    return {name: t for name, t in gpt.state_dict(keep_vars=True).items()
            if name.startswith(prefixes) and not name.endswith("_extra_state")}


def _model_layers(gpt: torch.nn.Module) -> list[int]:
    """Global (0-based) indices of the decoder layers this stage holds (megatron's layer_number - 1)."""
    return [layer.layer_number - 1 for layer in gpt.decoder.layers]


def _covered_prefixes(table: ArchitectureTable, exclude_prefixes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(prefix for prefix in table.model_prefixes if prefix not in exclude_prefixes)


def _model_rows(
    gpt: torch.nn.Module, hf_config: Any, exclude_prefixes: tuple[str, ...] = ()
) -> tuple[ModelDims, list[StageRow], dict[str, torch.Tensor]]:
    """The stage's rows under the model's own tensor names, and those tensors; ValueError unless they match
    one to one. Rows and model tensors under `exclude_prefixes` (whole top-level modules) are left out."""
    from megatron.core import parallel_state

    table = architecture_for(hf_config)
    dims = read_model_dims(hf_config, gpt.vocab_size)
    tensors = _model_tensors(gpt, _covered_prefixes(table, exclude_prefixes))
    rows = [
        dataclasses.replace(row, mcore=model_tensor_name(row.mcore, tensors))
        for row in stage_rows(table, hf_config, dims, _model_layers(gpt), gpt.pre_process, gpt.post_process,
                              parallel_state.get_expert_model_parallel_rank(),
                              parallel_state.get_expert_model_parallel_world_size())
        if not row.mcore.startswith(exclude_prefixes)
    ]
    missing = sorted(row.mcore for row in rows if row.mcore not in tensors)
    unmapped = sorted(set(tensors) - {row.mcore for row in rows})
    if missing or unmapped:
        raise ValueError(
            f"the model does not match the {table.label} table: "
            f"rows without a model tensor {missing}, model tensors without a row {unmapped}"
        )
    return dims, rows, tensors


def load_hf_weights(
    model: torch.nn.Module,
    hf_weights: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    skip_lm_output: bool = False,
) -> None:
    """Copy HF weights into this rank's part of a built megatron model (any TP/PP; call on every rank).

    The ranks come from megatron's parallel_state, the stage's layers and padded vocabulary from the
    model. `hf_config` describes the weights (its table chooses the rows). With `skip_lm_output`, the LM
    output layer (lm_head) is neither read nor expected in the model: a causal LM's backbone loaded into
    a model without one (a classifier PRM initialised from a policy; its head is left as it is). Raises
    ValueError as `hf_to_mcore_shards` does, and when the model has parameters that no table row fills
    or lacks ones a row expects.
    """
    from megatron.core import parallel_state

    gpt = _unwrap(model)
    exclude = ("output_layer.",) if skip_lm_output else ()
    _, _, tensors = _model_rows(gpt, hf_config, exclude)
    shards = iter_mcore_shards(
        hf_weights, hf_config,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        padded_vocab_size=gpt.vocab_size,
        layers=_model_layers(gpt),
        exclude_prefixes=exclude,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    with torch.no_grad():
        # One shard at a time: peak memory is the model plus one tensor, not two models.
        for name, shard in shards:
            name = model_tensor_name(name, tensors)
            target = tensors[name]
            if target.shape != shard.shape:
                raise ValueError(
                    f"megatron tensor {name!r} has shape {tuple(target.shape)} on this rank, but the "
                    f"HF weights give {tuple(shard.shape)}"
                )
            target.copy_(shard)


def _gather_tp(tensor: torch.Tensor, row: StageRow, group, tp_size: int) -> list[torch.Tensor]:
    if not row.layout.split or tp_size == 1:
        return [tensor.detach()]
    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return parts


def _full_tensors(row: StageRow, tensor: torch.Tensor, dims: ModelDims,
                  groups) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of a row on this stage: a split row gathered over the TP group; an expert's row
    gathered over the expert-parallel group, one expert of each EP rank (`row.hf_by_ep_rank` order)."""
    tp_group, tp_size, ep_group, ep_size = groups
    if not row.per_expert:
        yield from zip(row.hf, row.layout.to_hf(_gather_tp(tensor, row, tp_group, tp_size), dims))
        return
    parts = [tensor.detach()]
    if ep_size > 1:
        parts = [torch.empty_like(tensor) for _ in range(ep_size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=ep_group)
    for names, part in zip(row.hf_by_ep_rank, parts):
        yield from zip(names, row.layout.to_hf([part], dims))


def export_hf_weights(model: torch.nn.Module, hf_config: Any,
                      shard_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every HF weight, in HF order; collective over all ranks.

    ``shard_transform`` maps each of this rank's model tensors to the shard exported in its place, one at a time
    (LoRA: the base weight with its adapter merged in, ``grpo_mega.lora.StageAdapters.merged``).

    Every rank of the job must iterate to the end, in step: each tensor costs one all-gather over the
    TP group (for split layouts) and, with PP > 1, one broadcast over the PP group from the stage that
    owns it; an MoE model's experts cost one all-gather over the expert-parallel group per local expert and
    weight. Every rank receives every tensor, on the model's device and in the model's dtype, as a
    new tensor (never a view of a parameter). The iterator keeps nothing it has yielded, so peak extra
    memory is one table row's tensors (at most q, k, v and their merged parameter).
    """
    from megatron.core import parallel_state

    gpt = _unwrap(model)
    dims, rows, tensors = _model_rows(gpt, hf_config)
    rows = [row for row in rows if row.exported]
    groups = (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_expert_model_parallel_group(),
              parallel_state.get_expert_model_parallel_world_size())
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    device = next(iter(tensors.values())).device

    # What each stage will send: (name, shape, dtype) in order, so receivers can allocate.
    manifest = [(name, shape, tensors[row.mcore].dtype) for row in rows
                for names in (row.hf_by_ep_rank or (row.hf,)) for name, shape in zip(names, row.shapes)]
    manifests: list[Any] = [manifest] if pp_size == 1 else [None] * pp_size
    if pp_size > 1:
        dist.all_gather_object(manifests, manifest, group=pp_group)

    for stage, stage_manifest in enumerate(manifests):
        source = dist.get_global_rank(pp_group, stage) if pp_size > 1 else None
        if stage == my_stage:
            expected = {name: shape for name, shape, _ in manifest}
            for row in rows:
                shard = tensors[row.mcore] if shard_transform is None else shard_transform(tensors[row.mcore])
                for name, full in _full_tensors(row, shard, dims, groups):
                    if tuple(full.shape) != expected[name]:
                        raise ValueError(
                            f"exported {name!r} has shape {tuple(full.shape)}, the config implies {expected[name]}"
                        )
                    if pp_size > 1:
                        dist.broadcast(full, src=source, group=pp_group)
                    yield name, full
        else:
            for name, shape, dtype in stage_manifest:
                full = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(full, src=source, group=pp_group)
                yield name, full
