"""Hugging Face Qwen3-MoE config -> megatron-core's MoE fields (`moe_fields`).

Qwen3-MoE's router (transformers' ``Qwen3MoeTopKRouter``): softmax over all experts in fp32, the top-k, and with
``norm_topk_prob`` the top-k probabilities renormalised to sum to 1; no shared expert, no expert bias, every layer
sparse. megatron's ``TopKRouter`` with the softmax score function computes the same: with
``moe_router_pre_softmax=False`` it takes the top-k of the logits and softmaxes those k, which equals the
renormalised top-k of the full softmax (``norm_topk_prob=True``, the released models); with ``pre_softmax=True`` it
softmaxes all logits first and keeps the top-k as they are (``norm_topk_prob=False``). The router runs in fp32
(``moe_router_dtype``) as transformers' does.

The load-balancing loss is megatron's ``aux_loss`` (Switch-style: E * sum_e f_e * P_e per layer) with the HF
config's ``router_aux_loss_coef`` (a run's ``model.moe_aux_loss_coeff`` replaces it when the trainers load the config:
``grpo_mega.model.config_map.load_model_hf_config``). transformers
computes one such loss over all layers' router logits concatenated; megatron one per layer, each scaled by the
coefficient: the same quantity up to how it is pooled over layers (a regulariser either way).

Experts are split over ``parallel.expert`` ranks (expert parallelism), each expert whole on its rank
(``expert_tensor_parallel_size=1``, megatron's recommendation for fine-grained experts), and held as megatron's
``SequentialMLP`` (one MLP per local expert, ``decoder.layers.N.mlp.experts.local_experts.E.linear_fc1/fc2``), the
layout of the local layer spec and of Transformer Engine's spec without grouped GEMM.
"""

from __future__ import annotations

from typing import Any

# The token dispatcher is megatron's default (``TransformerConfig.moe_token_dispatcher_type``: ``allgather``) on the
# CPU and on GPUs: gloo has every collective it uses (all_gather_into_tensor, reduce_scatter_tensor), while
# ``alltoall`` creates a CUDA stream at construction and cannot run on the CPU.


def check_moe_supported(hf: Any) -> None:
    """ValueError naming the field for a Qwen3-MoE config megatron's MoE layer cannot reproduce."""
    if getattr(hf, "decoder_sparse_step", 1) != 1:
        raise ValueError(f"decoder_sparse_step={hf.decoder_sparse_step} is not supported (every layer sparse: 1)")
    if getattr(hf, "mlp_only_layers", None):
        raise ValueError(f"mlp_only_layers={hf.mlp_only_layers} is not supported (every layer sparse: [])")
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not getattr(hf, name, None):
            raise ValueError(f"{hf.model_type} config is missing required field {name}")
    if hf.num_experts_per_tok > hf.num_experts:
        raise ValueError(f"num_experts_per_tok={hf.num_experts_per_tok} exceeds num_experts={hf.num_experts}")


def moe_fields(hf: Any, *, ep: int = 1) -> dict[str, Any]:
    """megatron TransformerConfig fields of a Qwen3-MoE HF config at expert-parallel size ``ep``."""
    check_moe_supported(hf)
    if ep < 1 or hf.num_experts % ep:
        raise ValueError(f"parallel.expert={ep} must divide num_experts={hf.num_experts}")
    return dict(
        num_moe_experts=hf.num_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", False)),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0)),
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def fill_in_missing_te_gemm() -> None:
    """megatron-core 0.16's MoE router computes its logits through ``moe_utils.RouterGatingLinearFunction``, which
    tests ``te_general_gemm is not None`` to choose between Transformer Engine's GEMM and torch's; the name is only
    bound when TE imports, so without TE (every CPU run, a GPU without TE) the router raises NameError. Binding it
    to None where it is missing selects torch's path, as megatron intends; with TE nothing changes."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
