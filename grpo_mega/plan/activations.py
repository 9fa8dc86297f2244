"""Activation bytes of one update micro-batch, and of the forward-only passes (reference, PRM), per rank.

A transformer layer of megatron's local spec (the engine's layers: RMSNorm, fused QKV projection, rotary, fused
attention via SDPA, SwiGLU MLP) keeps these tensors for its backward, per token (h hidden, q = heads x head_dim,
kv = kv_heads x head_dim, f intermediate, t TP):

    3 x h   input norm (torch's RMSNorm, unfused): its input (the residual stream), the normalised input and
            the output (the QKV projection's input)
    (q + 2 kv) / t   the QKV projection's output (v is a view of it, so attention keeps the whole buffer)
    (q + kv) / t     q and k after rotary (new tensors, kept by attention)
    q / t            attention output (the output projection's input)
    3 x h   pre-MLP norm: the same three
    5 f / t          fc1 output (2f), its gate half after megatron's split (f), SiLU output (f), SwiGLU product
                     (f, the fc2 input)

(measured on CPU with saved-tensor hooks over the engine's layers; Transformer Engine's fused norms and SwiGLU keep
less, so on GPUs with TE this is an upper bound). The 6 h terms are split over TP ranks with sequence
parallelism. ``selective`` recompute drops attention's own
saved q / k / output (they are re-run); ``full`` recompute keeps only each layer's input (h, / t with sequence
parallelism) plus one layer's activations while it is re-run. Fused attention keeps no S x S matrix; its
log-sum-exp (fp32, one value per head and token) is small and counted.

A mixture-of-experts layer (Qwen3-MoE, megatron's MoE layer with the allgather dispatcher, experts whole on the
TP ranks, EP = TP) keeps instead of the dense MLP: the router's fp32 logits and probabilities (2 E fp32 per token of
this rank), the tokens gathered from the TP group (h per token of the micro-batch), and for each of the top-k expert
assignments that land on this rank's experts (k / t of them per token on average, x `EXPERT_LOAD_IMBALANCE` for the
busiest rank) the permuted input (h), the expert's SwiGLU (5 f_moe) and its weighted output (h).

Around the layers: the embedding output, the final norm's input and output (kept by the LM head), and in the
backward pass transients: the largest weight's gradient before megatron adds it to the fp32 gradient buffer (the
word embedding, V/t x h), and two activation-gradient buffers of the largest layer width. With pipeline
parallelism 1F1B keeps the activations of up to PP - stage micro-batches in flight on a stage. The log-prob chunk
buffers (``model.logprob_chunk_size`` x V/t, fp32) are counted apart (``logprob_buffer_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_mega.config.checks import num_experts

EXPERT_LOAD_IMBALANCE = 1.5
"""Tokens on the busiest expert-parallel rank over the mean, assumed for MoE activations (the load-balancing loss
keeps trained routers near 1; ``moe/expert_load_max_over_mean`` in the step metrics is the measured figure per
expert)."""


@dataclass(frozen=True)
class Shapes:
    """Model sizes as the planner needs them (from the HF config)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    """Padded vocabulary (rows of the embedding / output matrix over all TP ranks)."""
    experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    topk: int = 0
    """Experts each token is routed to."""
    expert_intermediate: int = 0
    """One expert's MLP width (moe_intermediate_size)."""

    @classmethod
    def from_hf(cls, hf: dict, padded_vocab: int) -> Shapes:
        heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
        experts = num_experts(hf)
        return cls(hidden=int(hf["hidden_size"]), heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
                   head_dim=head_dim, intermediate=int(hf["intermediate_size"]), layers=int(hf["num_hidden_layers"]),
                   vocab=padded_vocab, experts=experts,
                   topk=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
                   expert_intermediate=int(hf.get("moe_intermediate_size") or 0) if experts else 0)


def layer_elements_per_token(s: Shapes, tp: int, sequence_parallel: bool, recompute: str) -> float:
    """Elements one layer keeps for backward per token (module docstring)."""
    q, kv, h, f = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    replicated = 6 * h / (tp if sequence_parallel else 1)
    attention = (q + 2 * kv) / tp + (q + kv) / tp + q / tp
    if recompute == "selective":
        attention = (q + 2 * kv) / tp  # the QKV output is kept; attention re-runs from it
    mlp = 5 * f / tp
    if s.experts:
        local_tokens = 1 / (tp if sequence_parallel else 1)
        router = 2 * s.experts * 2 * local_tokens  # fp32 logits and probabilities, in bf16 elements
        assignments = s.topk / tp * EXPERT_LOAD_IMBALANCE
        mlp = router + h + assignments * (2 * h + 5 * s.expert_intermediate)
    return replicated + attention + mlp


def _lse_bytes_per_token(s: Shapes, tp: int) -> float:
    return 4 * s.heads / tp


def update_activation_bytes(s: Shapes, *, tokens: int, head_tokens: int, tp: int, pp: int, dtype_bytes: int,
                            sequence_parallel: bool = False, recompute: str = "none") -> int:
    """Peak activation bytes of one training micro-batch on the most loaded pipeline stage (the first with PP > 1,
    which keeps PP micro-batches in flight), log-prob buffers excluded. ``tokens``: tokens through the layers
    (packed tokens on the shared-prompt path); ``head_tokens``: tokens of the rows the LM head sees."""
    layers = s.layers // pp
    per_layer = (layer_elements_per_token(s, tp, sequence_parallel, recompute) * dtype_bytes
                 + _lse_bytes_per_token(s, tp))
    stream = s.hidden / (tp if sequence_parallel else 1) * dtype_bytes
    if recompute == "full":
        kept = layers * stream * tokens + per_layer * tokens  # layer inputs + the layer being re-run
    else:
        kept = layers * per_layer * tokens
    in_flight = pp  # first stage under 1F1B
    embedding = stream * tokens
    head = 0 if pp > 1 else 3 * s.hidden * dtype_bytes * head_tokens  # final norm in / out, unpacked rows
    last_stage_head = 3 * s.hidden * dtype_bytes * head_tokens
    widest = max(s.hidden, 2 * s.intermediate / tp, (s.heads + 2 * s.kv_heads) * s.head_dim / tp)
    backward = 2 * widest * dtype_bytes * max(tokens, head_tokens) + s.vocab // tp * s.hidden * dtype_bytes
    first_stage = in_flight * (kept + embedding) + head + backward
    last_stage = kept + last_stage_head + backward
    return int(max(first_stage, last_stage))


def forward_activation_bytes(s: Shapes, *, tokens: int, tp: int, dtype_bytes: int) -> int:
    """Peak of a forward-only pass (no graph kept): the residual stream in and out of a layer plus one layer's
    working set."""
    per_layer = layer_elements_per_token(s, tp, False, "none") * dtype_bytes + _lse_bytes_per_token(s, tp)
    return int(tokens * (per_layer + 2 * s.hidden * dtype_bytes))


def logprob_buffer_bytes(s: Shapes, *, chunk: int, head_tokens: int, tp: int) -> int:
    """The chunked log-prob / entropy buffers (``grpo_mega.model.logprobs``): two [chunk, V/t] fp32 buffers live
    at once in the forward (shifted logits and their exp) and in the backward (log p, then p), plus fp32 per-token
    statistics (log-normaliser, entropy, log-probs) of every head token."""
    rows = min(chunk, head_tokens)
    return int(2 * rows * (s.vocab // tp) * 4 + 3 * 4 * head_tokens)
