"""HF <-> megatron-core weight tables: one declarative table per architecture, its layouts named transforms.

A table row (`WeightMapping`) says: this megatron-core parameter (its name relative to `GPTModel`
built with the local layer spec) is made of these Hugging Face tensors, of these shapes, with this
layout: a named, invertible transform between the full HF tensors and one tensor-parallel (TP) shard
of the megatron parameter (`grpo_mega.checkpoint.hf_transforms`: replicated, row, vocab_rows,
qkv_grouped, gate_up).

Layer rows carry "{layer}": the global (HF) layer index in HF names, the index local to the pipeline
stage in megatron names (`stage_layers` gives a stage's global layers). Column-parallel weights of
these architectures are all merged ones (qkv_grouped, gate_up).

Megatron names are those of the local layer spec; with Transformer Engine's spec the two pre-norms
are fused into the next linear and carry other names (`model_tensor_name`).

A table is chosen by `model_type` (qwen2, llama, qwen3), except for process reward models named by
`architectures`: Qwen2ForProcessRewardModel (Qwen2.5-Math-PRM) is a Qwen2 backbone without lm_head plus a step
classifier `score.0` (Linear H->H) / `score.2` (Linear H->2), held by the megatron model as its
head `head.score.*`, replicated over TP ranks, on the last pipeline stage; Qwen3ForProcessRewardModel is the
same on a Qwen3 backbone.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_mega.checkpoint.hf_transforms import (
    GATE_UP,
    QKV_GROUPED,
    REPLICATED,
    ROW,
    VOCAB_ROWS,
    Layout,
    ModelDims,
)
from grpo_mega.checkpoint.prm_architectures import (  # noqa: F401  re-exported: the tables' users read them here
    PRM_CLASSIFIER_ARCHITECTURE,
    PRM_CLASSIFIER_ARCHITECTURES,
    is_prm_classifier,
)

# ----------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class WeightMapping:
    """One megatron parameter and the HF tensors it is made of."""

    mcore: str
    """Name relative to GPTModel; "{layer}" = index local to the pipeline stage."""
    hf: tuple[str, ...]
    """HF names, in the order the layout takes them; "{layer}" = global layer index."""
    shapes: tuple[tuple[str, ...], ...]
    """Shape of each HF tensor, as names of `ModelDims` fields/properties."""
    layout: Layout
    stage: str
    """Where the parameter lives: 'first' (pipeline stage 0), 'layer' (every stage), 'last'."""
    only_if: str | None = None
    """HF config boolean that must be true for the parameter to exist (e.g. 'attention_bias')."""
    tied_to: str | None = None
    """With tie_word_embeddings the HF checkpoint has no tensor of its own for this row: a megatron
    copy on a stage without the embedding is built from this HF tensor, and export skips the row."""
    per_expert: bool = False
    """One row per expert of an MoE layer: "{expert}" is the index local to the expert-parallel rank in the
    megatron name, the global expert in HF names. The expert is whole on its rank (no TP split)."""


# The GPTModel's own modules. Other submodules of a policy stage are heads (the engine's `head`,
# e.g. the PRM step scorer): not part of a causal LM's HF model, so its conversion leaves them alone.
BACKBONE_PREFIXES = ("embedding.", "decoder.", "output_layer.")


@dataclass(frozen=True)
class ArchitectureTable:
    """The weight table of one HF architecture (`model_type`, or a PRM's `architectures` entry)."""

    model_type: str
    mappings: tuple[WeightMapping, ...]
    architecture: str | None = None
    """The HF `architectures` name that selects this table over the model_type's (a PRM), else None."""
    model_prefixes: tuple[str, ...] = BACKBONE_PREFIXES
    """Top-level submodules of the megatron stage whose tensors the table covers, all of them."""
    lm_output: bool = True
    """Whether the megatron model has an LM output layer (`build_gpt_model(lm_output=...)`)."""

    @property
    def label(self) -> str:
        """How messages name the table: the model_type, with the architecture when it selects it."""
        return f"{self.model_type} ({self.architecture})" if self.architecture else self.model_type


_H, _Q, _KV, _F, _V = "hidden_size", "q_size", "kv_size", "ffn_hidden_size", "vocab_size"
_ATTN = "model.layers.{layer}.self_attn."
_MLP = "model.layers.{layer}.mlp."
_LAYER = "decoder.layers.{layer}."

_EMBEDDING = WeightMapping(
    "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ((_V, _H),), VOCAB_ROWS,
    "first",
)
_LAYER_WEIGHTS = (
    WeightMapping(_LAYER + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",),
                  ((_H,),), REPLICATED, "layer"),
    WeightMapping(_LAYER + "self_attention.linear_qkv.weight",
                  (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
                  ((_Q, _H), (_KV, _H), (_KV, _H)), QKV_GROUPED, "layer"),
    WeightMapping(_LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",),
                  ((_H, _Q),), ROW, "layer"),
    WeightMapping(_LAYER + "pre_mlp_layernorm.weight",
                  ("model.layers.{layer}.post_attention_layernorm.weight",), ((_H,),), REPLICATED,
                  "layer"),
    WeightMapping(_LAYER + "mlp.linear_fc1.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"),
                  ((_F, _H), (_F, _H)), GATE_UP, "layer"),
    WeightMapping(_LAYER + "mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), ((_H, _F),), ROW,
                  "layer"),
)
_FINAL = (
    WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), ((_H,),), REPLICATED,
                  "last"),
    WeightMapping("output_layer.weight", ("lm_head.weight",), ((_V, _H),), VOCAB_ROWS, "last",
                  tied_to="model.embed_tokens.weight"),
)


def _qkv_bias(only_if: str | None) -> WeightMapping:
    return WeightMapping(
        _LAYER + "self_attention.linear_qkv.bias",
        (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"),
        ((_Q,), (_KV,), (_KV,)), QKV_GROUPED, "layer", only_if=only_if,
    )


# Qwen2: q/k/v projections always have a bias, o_proj and the MLP never do.
QWEN2 = ArchitectureTable("qwen2", (_EMBEDDING, *_LAYER_WEIGHTS, _qkv_bias(None), *_FINAL))

# Llama: attention_bias puts a bias on q/k/v and o_proj, mlp_bias on gate/up/down (both off in the
# released Llama models). A row-parallel bias is added once after the reduction: replicated.
LLAMA = ArchitectureTable("llama", (
    _EMBEDDING,
    *_LAYER_WEIGHTS,
    _qkv_bias("attention_bias"),
    WeightMapping(_LAYER + "self_attention.linear_proj.bias", (_ATTN + "o_proj.bias",), ((_H,),),
                  REPLICATED, "layer", only_if="attention_bias"),
    WeightMapping(_LAYER + "mlp.linear_fc1.bias", (_MLP + "gate_proj.bias", _MLP + "up_proj.bias"),
                  ((_F,), (_F,)), GATE_UP, "layer", only_if="mlp_bias"),
    WeightMapping(_LAYER + "mlp.linear_fc2.bias", (_MLP + "down_proj.bias",), ((_H,),), REPLICATED,
                  "layer", only_if="mlp_bias"),
    *_FINAL,
))

# Qwen3: Llama's rows (no biases) and an RMSNorm over head_dim on every query and key head (q_norm / k_norm,
# megatron's q_layernorm / k_layernorm: one [head_dim] weight shared by all heads, so every TP rank holds it whole).
QWEN3 = ArchitectureTable("qwen3", (
    _EMBEDDING,
    *_LAYER_WEIGHTS,
    WeightMapping(_LAYER + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",), (("head_dim",),),
                  REPLICATED, "layer"),
    WeightMapping(_LAYER + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",), (("head_dim",),),
                  REPLICATED, "layer"),
    *_FINAL,
))

# Qwen3-MoE: Qwen3's attention; every layer's MLP is a router (mlp.gate, [experts, hidden], replicated) and experts
# held by megatron's SequentialMLP, each expert's gate/up merged into its linear_fc1 (a TP split of 1: [gate; up]).
_EXPERT = _LAYER + "mlp.experts.local_experts.{expert}."
_HF_EXPERT = _MLP + "experts.{expert}."
_MOE_F = "moe_ffn_hidden_size"
QWEN3_MOE = ArchitectureTable("qwen3_moe", (
    _EMBEDDING,
    *(m for m in QWEN3.mappings if m.stage == "layer" and ".mlp." not in m.mcore),
    WeightMapping(_LAYER + "mlp.router.weight", (_MLP + "gate.weight",), (("num_experts", _H),), REPLICATED,
                  "layer"),
    WeightMapping(_EXPERT + "linear_fc1.weight", (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"),
                  ((_MOE_F, _H), (_MOE_F, _H)), GATE_UP, "layer", per_expert=True),
    WeightMapping(_EXPERT + "linear_fc2.weight", (_HF_EXPERT + "down_proj.weight",), ((_H, _MOE_F),), ROW, "layer",
                  per_expert=True),
    *_FINAL,
))

ARCHITECTURES: dict[str, ArchitectureTable] = {
    table.model_type: table for table in (QWEN2, LLAMA, QWEN3, QWEN3_MOE)}

def _prm_classifier(backbone: ArchitectureTable) -> ArchitectureTable:
    """A backbone's rows without the LM head, then Qwen2.5-Math-PRM's step classifier (replicated: every TP rank
    holds the whole head and computes it on the same hidden states)."""
    return ArchitectureTable(
        backbone.model_type,
        (
            *(m for m in backbone.mappings if m.mcore != "output_layer.weight"),
            WeightMapping("head.score.0.weight", ("score.0.weight",), ((_H, _H),), REPLICATED, "last"),
            WeightMapping("head.score.0.bias", ("score.0.bias",), ((_H,),), REPLICATED, "last"),
            WeightMapping("head.score.2.weight", ("score.2.weight",), (("score_classes", _H),), REPLICATED,
                          "last"),
            WeightMapping("head.score.2.bias", ("score.2.bias",), (("score_classes",),), REPLICATED, "last"),
        ),
        architecture=PRM_CLASSIFIER_ARCHITECTURES[backbone.model_type],
        model_prefixes=("embedding.", "decoder.", "head."),
        lm_output=False,
    )


QWEN2_PRM_CLASSIFIER = _prm_classifier(QWEN2)
QWEN3_PRM_CLASSIFIER = _prm_classifier(QWEN3)

# HF `architectures` entries that select a table of their own; model_type must match the table's.
ARCHITECTURES_BY_NAME: dict[str, ArchitectureTable] = {
    table.architecture: table for table in (QWEN2_PRM_CLASSIFIER, QWEN3_PRM_CLASSIFIER)}


# Transformer Engine's layer spec fuses each pre-norm into the linear that follows it; the local spec
# keeps separate norm modules. Same tensor, two names (megatron's own sharded_state_dict_keys_map
# pairs them the same way).
FUSED_NORM_NAMES = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
)


def model_tensor_name(name: str, model_names: Container[str]) -> str:
    """The name a table row's tensor has in a model: the local-spec `name` if the model has it, else
    its Transformer Engine (fused pre-norm) alias if the model has that, else `name` unchanged."""
    if name in model_names:
        return name
    for local, fused in FUSED_NORM_NAMES:
        if name.endswith(local):
            alias = name[: -len(local)] + fused
            if alias in model_names:
                return alias
    return name


def architecture_for(hf_config: Any) -> ArchitectureTable:
    """The table of `hf_config`: the one its `architectures` name (a PRM, `ARCHITECTURES_BY_NAME`), else the
    one of its `model_type`. ValueError naming the model_type when there is none, or when a PRM architecture
    comes with another model_type than its table's."""
    model_type = getattr(hf_config, "model_type", None)
    for name in getattr(hf_config, "architectures", None) or ():
        table = ARCHITECTURES_BY_NAME.get(name)
        if table is not None:
            if model_type != table.model_type:
                raise ValueError(
                    f"architectures {name!r} is a {table.model_type} model, but the config has model_type "
                    f"{model_type!r}"
                )
            return table
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} has no HF <-> megatron weight table; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]


# ----------------------------------------------------------------------------------------------
# Rows of one pipeline stage, with concrete names


@dataclass(frozen=True)
class StageRow:
    """A `WeightMapping` resolved for one layer of one stage: concrete names and shapes."""

    mcore: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    layout: Layout
    exported: bool
    """False for the tied output-layer copy: its HF tensor is the embedding, exported by stage 0."""
    hf_by_ep_rank: tuple[tuple[str, ...], ...] = ()
    """An expert's row: the HF names of the expert at this local index on each expert-parallel rank (`hf` is this
    rank's); empty for every other row."""

    @property
    def per_expert(self) -> bool:
        """Whether the row is one expert's (whole on its expert-parallel rank, never split over TP)."""
        return bool(self.hf_by_ep_rank)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global indices of the decoder layers on pipeline stage `pp_rank`: an even split.

    Stage r holds layers [r*L/pp, (r+1)*L/pp), as megatron-core places them without an explicit
    pipeline layout. Raises ValueError when pp_size does not divide num_layers.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside pipeline_parallel={pp_size}")
    if num_layers % pp_size != 0:
        raise ValueError(f"pipeline_parallel={pp_size} does not divide num_layers={num_layers}")
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def stage_rows(
    table: ArchitectureTable,
    hf_config: Any,
    dims: ModelDims,
    global_layers: Sequence[int],
    is_first: bool,
    is_last: bool,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[StageRow]:
    """The rows of one pipeline stage in HF order (embedding, layers, final norm, LM head).

    `global_layers[i]` is the global index of the stage's local layer i. Rows whose `only_if` config
    flag is false are left out; with tied embeddings the output layer exists only on a last stage that
    is not also the first (megatron keeps a copy there) and is sourced from the embedding. An MoE layer's
    experts are split over `ep_size` expert-parallel ranks in contiguous blocks (megatron's placement): rank r
    holds experts [r * E / ep_size, (r + 1) * E / ep_size).
    """
    rows: list[StageRow] = []
    if dims.num_experts and dims.num_experts % ep_size:
        raise ValueError(f"expert_parallel={ep_size} does not divide num_experts={dims.num_experts}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert rank {ep_rank} is outside expert_parallel={ep_size}")
    local_experts = dims.num_experts // ep_size

    def add(mapping: WeightMapping, local: int | None = None, global_layer: int | None = None):
        hf_names = mapping.hf
        exported = True
        if mapping.tied_to is not None and dims.tie_word_embeddings:
            if is_first:
                return  # megatron reuses the embedding parameter itself: no separate tensor
            hf_names, exported = (mapping.tied_to,), False
        shapes = tuple(tuple(getattr(dims, d) for d in shape) for shape in mapping.shapes)
        if not mapping.per_expert:
            rows.append(StageRow(mapping.mcore.format(layer=local),
                                 tuple(name.format(layer=global_layer) for name in hf_names), shapes,
                                 mapping.layout, exported))
            return
        for expert in range(local_experts):
            by_rank = tuple(tuple(name.format(layer=global_layer, expert=rank * local_experts + expert)
                                  for name in hf_names) for rank in range(ep_size))
            rows.append(StageRow(mapping.mcore.format(layer=local, expert=expert), by_rank[ep_rank], shapes,
                                 mapping.layout, exported, hf_by_ep_rank=by_rank))

    active = [m for m in table.mappings if m.only_if is None or getattr(hf_config, m.only_if, False)]
    if is_first:
        for mapping in (m for m in active if m.stage == "first"):
            add(mapping)
    for local, global_layer in enumerate(global_layers):
        for mapping in (m for m in active if m.stage == "layer"):
            add(mapping, local, global_layer)
    if is_last:
        for mapping in (m for m in active if m.stage == "last"):
            add(mapping)
    return rows
