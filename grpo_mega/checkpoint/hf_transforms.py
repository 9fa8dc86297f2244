"""HF <-> megatron-core weight layouts: the sizes they need, and each layout as a named, invertible transform
between the full Hugging Face tensors and one tensor-parallel (TP) shard of the megatron parameter:

  replicated   every TP rank holds the whole tensor (norm weights, biases of row-parallel linears)
  row          split along dim 1, the input features (row-parallel linear)
  vocab_rows   rows zero-padded up to the padded vocabulary, then split along dim 0; export trims
  qkv_grouped  q, k, v merged per query group g as [q heads of g | k_g | v_g], then split along dim 0
               (each TP rank holds whole groups)
  gate_up      gate and up projections merged so that TP shard i is [gate_i; up_i]

The tables that say which parameter takes which layout are in `grpo_mega.checkpoint.hf_layouts`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class ModelDims:
    """The sizes the layouts need, read from an HF config (`read_model_dims`)."""

    num_layers: int
    """num_hidden_layers."""
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """num_key_value_heads (GQA groups); equals num_attention_heads without GQA."""
    head_dim: int
    """head_dim from the config, else hidden_size / num_attention_heads."""
    ffn_hidden_size: int
    """intermediate_size."""
    vocab_size: int
    """The tokenizer's vocabulary: rows of the HF embedding and lm_head."""
    padded_vocab_size: int
    """Rows of the megatron embedding and output layer: vocab_size rounded up so TP splits it evenly."""
    tie_word_embeddings: bool
    """The LM head reuses the input embedding (no lm_head.weight / output_layer.weight of its own)."""
    num_experts: int = 0
    """Experts of each MoE layer (num_experts of a Qwen3-MoE config); 0 for a dense model."""
    moe_ffn_hidden_size: int = 0
    """moe_intermediate_size: the hidden width of one expert's MLP."""

    @property
    def score_classes(self) -> int:
        """Outputs of a PRM step classifier: 2 (bad, good)."""
        return 2

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def q_size(self) -> int:
        """Rows of q_proj: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj and of v_proj: num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim


def read_model_dims(hf_config: Any, padded_vocab_size: int) -> ModelDims:
    """Read `ModelDims` from a transformers config (Qwen2Config, LlamaConfig, ...).

    Raises ValueError naming the field when a size is missing or inconsistent (heads not a multiple of
    key/value heads, a padded vocabulary smaller than the vocabulary).
    """
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size")
    missing = [field for field in required if getattr(hf_config, field, None) is None]
    if missing:
        raise ValueError(f"HF config ({_model_type(hf_config)}) lacks field(s) {missing}")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % groups != 0:
        raise ValueError(
            f"HF config: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
        )
    if padded_vocab_size < hf_config.vocab_size:
        raise ValueError(
            f"padded_vocab_size={padded_vocab_size} is smaller than vocab_size={hf_config.vocab_size}"
        )
    return ModelDims(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded_vocab_size,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        num_experts=int(getattr(hf_config, "num_experts", None) or 0),
        moe_ffn_hidden_size=int(getattr(hf_config, "moe_intermediate_size", None) or 0),
    )


def _model_type(hf_config: Any) -> str:
    return getattr(hf_config, "model_type", None) or type(hf_config).__name__


def _part_size(total: int, tp_size: int, what: str) -> int:
    """total / tp_size, or a ValueError naming what does not split."""
    if total % tp_size != 0:
        raise ValueError(f"tensor_parallel={tp_size} does not divide {what}={total}")
    return total // tp_size


# ----------------------------------------------------------------------------------------------
# Layouts: named transforms between full HF tensors and one TP shard


class Layout(ABC):
    """A named transform: `to_mcore` builds TP shard `tp_rank`, `to_hf` inverts from all shards."""

    name = "layout"
    split = True
    """False when every TP rank holds the whole tensor (then export needs no gather)."""

    @abstractmethod
    def to_mcore(
        self, hf: Sequence[torch.Tensor], dims: ModelDims, tp_rank: int, tp_size: int
    ) -> torch.Tensor:
        """Return TP shard `tp_rank` of `tp_size` of the megatron tensor made from the HF tensors."""

    @abstractmethod
    def to_hf(self, shards: Sequence[torch.Tensor], dims: ModelDims) -> tuple[torch.Tensor, ...]:
        """Return the full HF tensors from the megatron TP shards, given in TP rank order."""

    def __repr__(self) -> str:
        return self.name


class Replicated(Layout):
    """Every TP rank holds the whole tensor."""

    name = "replicated"
    split = False

    def to_mcore(self, hf, dims, tp_rank, tp_size):
        """A copy of the HF tensor: shard == full tensor."""
        return hf[0].clone()

    def to_hf(self, shards, dims):
        """A copy of any rank's tensor (the first), never the parameter itself."""
        return (shards[0].clone(),)


class SplitDim(Layout):
    """Split along one dimension into `tp_size` equal contiguous parts (row-parallel: dim 1)."""

    def __init__(self, name: str, dim: int) -> None:
        self.name, self.dim = name, dim

    def to_mcore(self, hf, dims, tp_rank, tp_size):
        """Part `tp_rank` of hf[0] along `dim` (a copy, so the full tensor can be freed)."""
        full = hf[0]
        part = _part_size(full.shape[self.dim], tp_size, f"{self.name} dim {self.dim} size")
        return full.narrow(self.dim, tp_rank * part, part).clone()

    def to_hf(self, shards, dims):
        """Concatenation of the shards along `dim`."""
        return (torch.cat(list(shards), dim=self.dim),)


class VocabRows(Layout):
    """Rows = tokens: zero-pad to `padded_vocab_size`, split along dim 0; export drops the padding."""

    name = "vocab_rows"

    def to_mcore(self, hf, dims, tp_rank, tp_size):
        """Rows [r*P/tp, (r+1)*P/tp) of the table padded with zero rows to P = padded_vocab_size."""
        full = hf[0]
        part = _part_size(dims.padded_vocab_size, tp_size, "padded_vocab_size")
        start, stop = tp_rank * part, (tp_rank + 1) * part
        shard = full.new_zeros((part, *full.shape[1:]))
        real = max(0, min(stop, dims.vocab_size) - start)
        shard[:real] = full[start : start + real]
        return shard

    def to_hf(self, shards, dims):
        """All shards stacked, the first vocab_size rows (padding rows trimmed)."""
        return (torch.cat(list(shards), dim=0)[: dims.vocab_size].contiguous(),)


class QKVGrouped(Layout):
    """q, k, v merged per query group: rows [q_g (heads_per_group*head_dim) | k_g | v_g] for each g.

    Works for weights [rows, hidden] and biases [rows]. TP rank r holds groups
    [r*G/tp, (r+1)*G/tp), so every rank has whole query groups with their key/value heads.
    """

    name = "qkv_grouped"

    def to_mcore(self, hf, dims, tp_rank, tp_size):
        """Interleave the query groups of this rank: cat over g of [q_g; k_g; v_g]."""
        q, k, v = hf
        groups = _part_size(dims.num_query_groups, tp_size, "num_query_groups (num_key_value_heads)")
        rest = q.shape[1:]
        first = tp_rank * groups
        q = q.reshape(dims.num_query_groups, dims.heads_per_group * dims.head_dim, *rest)
        k = k.reshape(dims.num_query_groups, dims.head_dim, *rest)
        v = v.reshape(dims.num_query_groups, dims.head_dim, *rest)
        mine = slice(first, first + groups)
        return torch.cat([q[mine], k[mine], v[mine]], dim=1).reshape(-1, *rest)

    def to_hf(self, shards, dims):
        """Split the concatenated groups back into q_proj, k_proj, v_proj rows."""
        full = torch.cat(list(shards), dim=0)
        rest = full.shape[1:]
        grouped = full.reshape(dims.num_query_groups, (dims.heads_per_group + 2) * dims.head_dim, *rest)
        q, k, v = grouped.split([dims.heads_per_group * dims.head_dim, dims.head_dim, dims.head_dim], 1)
        return tuple(part.reshape(-1, *rest).contiguous() for part in (q, k, v))


class GateUp(Layout):
    """SwiGLU fc1: TP shard i is [gate_i; up_i], gate_i and up_i being part i of gate_proj and up_proj.

    At TP=1 this is [gate; up], the order megatron's `glu` activation splits (first half gated by silu).
    """

    name = "gate_up"

    def to_mcore(self, hf, dims, tp_rank, tp_size):
        """cat(gate part tp_rank, up part tp_rank) along dim 0."""
        gate, up = hf
        part = _part_size(gate.shape[0], tp_size, "intermediate_size (ffn_hidden_size)")
        rows = slice(tp_rank * part, (tp_rank + 1) * part)
        return torch.cat([gate[rows], up[rows]], dim=0)

    def to_hf(self, shards, dims):
        """gate_proj = cat of the first halves of the shards, up_proj = cat of the second halves."""
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate = torch.cat([half[0] for half in halves], dim=0)
        up = torch.cat([half[1] for half in halves], dim=0)
        return gate, up


REPLICATED = Replicated()
ROW = SplitDim("row", 1)
VOCAB_ROWS = VocabRows()
QKV_GROUPED = QKVGrouped()
GATE_UP = GateUp()
