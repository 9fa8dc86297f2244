"""Core attention through torch's fused scaled-dot-product attention, for megatron-core's local layers.

megatron-core's own `DotProductAttention` (the local spec's core attention when Transformer Engine is absent, i.e.
on every CPU run) writes the full [b * heads, s, s] score matrix through `baddbmm` into a preallocated buffer,
rebuilds the causal mask with `triu` in every layer, repeats K and V for grouped-query attention and copies the
context back to [s, b, h]. `torch.nn.functional.scaled_dot_product_attention` does the same causal softmax
attention in one fused kernel (forward and backward) with grouped-query attention built in.

`SDPADotProductAttention` takes that path in the case the engines always use (causal attention, no explicit mask:
rows are right-padded, see `grpo_mega.engine.base`, no dropout, no sliding window, no query-key layer scaling,
vanilla softmax, queries and keys of the same length) and hands anything else to megatron's implementation, so it
is a drop-in replacement with the same parameters (none) and checkpoints.

It also runs packed micro-batches whose rows share their prompt tokens (``grpo_mega.engine.shared_prefix``): given
a :class:`PackedRows` as megatron's ``packed_seq_params``, the packed sequence's queries, keys and values are
gathered into rows (each row: its prompt's tokens, then its own response), attended causally row by row, and each
packed token's context is read back from the row that owns it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType


class PackedRows(PackedSeqParams):
    """Where the rows of a packed micro-batch live in its packed sequence: ``row_gather`` [R, L] (packed token of
    each row position), ``source`` [T] (flat row position ``r * L + p`` each packed token is read back from) and
    ``positions`` [T'] (each packed token's position in its row, the rotary position; T' >= T when the sequence is
    padded for sequence parallelism, the padding tokens at the end).

    It reaches the attention as megatron's ``packed_seq_params`` (format ``sbhd``, which megatron treats as an
    ordinary sequence), the one argument megatron hands from the model to every layer's core attention, also
    when activation recompute re-runs a layer or its attention in the backward pass."""

    def __init__(self, row_gather: torch.Tensor, source: torch.Tensor, positions: torch.Tensor):
        max_position = int(positions.max()) + 1
        super().__init__(qkv_format="sbhd", max_seqlen_q=max_position, max_seqlen_kv=max_position)
        self.row_gather = row_gather
        self.source = source
        self.positions = positions

    def to_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """[T', ...] -> [R, L, ...]."""
        rows, width = self.row_gather.shape
        return packed.index_select(0, self.row_gather.reshape(-1)).view(rows, width, *packed.shape[1:])

    def to_packed(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, L, ...] -> [T', ...]; the padding tokens past T get zeros (nothing reads them)."""
        packed = rows.reshape(-1, *rows.shape[2:]).index_select(0, self.source)
        padding = len(self.positions) - len(self.source)
        if padding:
            packed = torch.cat((packed, packed.new_zeros(padding, *packed.shape[1:])))
        return packed

    def padded(self, length: int) -> "PackedRows":
        """The same rows in a packed sequence of ``length`` >= T' tokens (padding tokens at rotary position 0)."""
        extra = length - len(self.positions)
        if extra < 0:
            raise ValueError(f"cannot pad a packed sequence of {len(self.positions)} tokens to {length}")
        return PackedRows(self.row_gather, self.source, torch.nn.functional.pad(self.positions, (0, extra)))


class SDPADotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention computed by `F.scaled_dot_product_attention` where it applies."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        self.fused = (
            self.attn_mask_type == AttnMaskType.causal
            and self.attention_dropout.p == 0.0
            and self.scale_mask_softmax.window_size is None
            and not config.apply_query_key_layer_scaling
            and self.softmax_offset is None
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key / value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if isinstance(packed_seq_params, PackedRows):
            return self._packed_forward(query, key, value, packed_seq_params)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if (
            not self.fused
            or attention_mask is not None
            or mask_type != AttnMaskType.causal
            or attention_bias is not None
            or packed_seq_params is not None
            or query.size(0) != key.size(0)
        ):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, heads, hn] -> [b, heads, s, hn]; sdpa repeats the K/V groups itself (enable_gqa)
        context = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=key.size(2) != query.size(2),
        )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        sq, b = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed_forward(self, query, key, value, packed: PackedRows):
        """query [T, 1, np, hn], key / value [T, 1, ng, hn] of a packed sequence -> context [T, 1, np * hn]."""
        if not self.fused or query.size(1) != 1:
            raise ValueError("packed rows need the fused causal attention and a packed [T, 1] sequence")

        def rows(x):  # [T, 1, heads, hn] -> [R, heads, L, hn]
            return packed.to_rows(x[:, 0]).transpose(1, 2)

        context = F.scaled_dot_product_attention(
            rows(query), rows(key), rows(value), is_causal=True, scale=self.softmax_scale,
            enable_gqa=key.size(2) != query.size(2),
        )
        # [R, np, L, hn] -> [R, L, np * hn] -> [T, 1, np * hn]
        context = context.transpose(1, 2).reshape(*packed.row_gather.shape, self.hidden_size_per_partition)
        return packed.to_packed(context).unsqueeze(1)


def use_sdpa_core_attention(layer_spec) -> None:
    """Point a local transformer-layer spec's self-attention at `SDPADotProductAttention` (in place)."""
    attention = layer_spec.submodules.self_attention.submodules
    if attention.core_attention is not DotProductAttention:
        raise ValueError(f"expected megatron's DotProductAttention in the layer spec, found {attention.core_attention}")
    attention.core_attention = SDPADotProductAttention
