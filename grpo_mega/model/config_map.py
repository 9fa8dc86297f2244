"""Hugging Face config (Qwen2, Llama, Qwen3) -> megatron-core TransformerConfig and GPTModel arguments.

One table, `HF_TO_MCORE_FIELDS`, maps the HF fields that carry over by value; `FAMILY_SETTINGS` are
the choices shared by every family (RMSNorm, SwiGLU, no linear biases, RoPE, no dropout);
`FAMILIES` says where they differ: q/k/v biases (Qwen2) and RMSNorm on every query and key head before RoPE
(Qwen3: megatron's `qk_layernorm`, its head_dim independent of hidden_size / heads), and mixture-of-experts MLPs
(Qwen3-MoE: `grpo_mega.model.moe_config`). RoPE (base and llama3 scaling) is read from
`config.rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling` (transformers 4).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from grpo_mega.model.moe_config import moe_fields
from grpo_mega.parallel.distributed import get_device
from grpo_mega.parallel.layout import validate_model_split

# (HF field, TransformerConfig field, required). Optional fields left unset keep megatron's default,
# which matches HF's (kv_channels = hidden_size / num_attention_heads).
HF_TO_MCORE_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("hidden_size", "hidden_size", True),
    ("num_hidden_layers", "num_layers", True),
    ("num_attention_heads", "num_attention_heads", True),
    ("num_key_value_heads", "num_query_groups", False),  # absent: multi-head attention
    ("intermediate_size", "ffn_hidden_size", True),
    ("rms_norm_eps", "layernorm_epsilon", True),
    ("head_dim", "kv_channels", False),
    ("initializer_range", "init_method_std", False),
)

# Architecture shared by Qwen2 and Llama. Dropout is off: RL log-prob ratios need a deterministic
# policy, and neither family trains with dropout.
FAMILY_SETTINGS: dict[str, Any] = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)



@dataclass(frozen=True)
class Family:
    """What sets one HF model_type apart from `FAMILY_SETTINGS`."""

    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2 always; Llama's and Qwen3's attention_bias=True would also bias
    o_proj, which `_check_supported` rejects)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on every query and key head, before RoPE (megatron's `qk_layernorm`)."""
    moe: bool = False
    """Mixture-of-experts MLPs (`grpo_mega.model.moe_config`)."""


FAMILIES: dict[str, Family] = {
    "qwen2": Family(qkv_bias=True),
    "llama": Family(qkv_bias=False),
    "qwen3": Family(qkv_bias=False, qk_norm=True),
    "qwen3_moe": Family(qkv_bias=False, qk_norm=True, moe=True),
}

# parallel.recompute -> megatron's activation-recompute fields. "selective" is megatron's selective recompute with
# its default modules (the core attention: the [s, s] scores, Korthikanti et al. 2022). "full" re-runs every
# transformer layer in the backward pass from its saved input (method uniform, one layer per checkpoint: megatron's
# usual choice, the smallest peak: one layer's activations live at a time, plus every layer's [s, b, h] input).
RECOMPUTE_SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}

# megatron-core implements llama3 RoPE scaling with these constants fixed; only the factor is free.
_LLAMA3_FIXED_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class GPTConfig:
    """Everything needed to build the mcore GPTModel of an HF checkpoint's architecture."""

    transformer: TransformerConfig
    """Per-layer architecture, parallel sizes and dtypes."""
    model_type: str
    """HF model_type: a key of `FAMILIES`."""
    vocab_size: int
    """Tokenizer vocabulary size from the HF config (rows that mean a token)."""
    padded_vocab_size: int
    """Embedding / output rows after padding for TP (`padded_vocab_size`)."""
    max_sequence_length: int
    """HF max_position_embeddings."""
    rotary_base: float
    """RoPE theta."""
    rope_scaling_factor: float | None
    """llama3 RoPE scaling factor, or None for plain RoPE."""
    tie_word_embeddings: bool
    """Whether the output layer reuses the input embedding matrix."""


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest multiple of lcm(divisible_by, tp) that is >= vocab_size.

    Megatron-LM pads to a multiple of divisible_by * tp, which changes the padded size with TP and
    breaks resharding checkpoints across TP; lcm gives the same size for every TP dividing
    divisible_by (1, 2, 4, ..., 128), while every TP rank still holds an equal shard.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("tensor_parallel", tp),
        ("divisible_by", divisible_by),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def _rope_settings(hf: Any) -> tuple[float, float | None]:
    """Return (rope theta, llama3 scaling factor or None) from either transformers layout."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise ValueError(
            f"{hf.model_type} config has no rope_theta (nor rope_parameters.rope_theta)"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        for key, expected in _LLAMA3_FIXED_ROPE.items():
            if float(rope.get(key, expected)) != expected:
                raise ValueError(
                    f"rope_parameters.{key}={rope[key]} is not supported: megatron-core's llama3 "
                    f"RoPE scaling fixes it to {expected}"
                )
        return float(theta), float(rope["factor"])
    raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported (default, llama3)")


def _check_supported(hf: Any) -> None:
    model_type = getattr(hf, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported: "
            f"{sorted(FAMILIES)}"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported (SwiGLU needs 'silu')")
    if not FAMILIES[model_type].qkv_bias and getattr(hf, "attention_bias", False):
        raise ValueError(
            f"{model_type} attention_bias=True is not supported: HF then biases o_proj too, and megatron-core can "
            "bias the output projection only together with the MLP (add_bias_linear)"
        )
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (megatron add_bias_linear=False)")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported (full attention only)")
    windowed = sorted({kind for kind in getattr(hf, "layer_types", None) or () if kind != "full_attention"})
    if windowed:
        raise ValueError(f"layer_types {windowed} are not supported (full attention only)")


def _as_hf_config(hf_config: Any) -> Any:
    if isinstance(hf_config, Mapping):
        from transformers import AutoConfig

        config = dict(hf_config)
        if "model_type" not in config:
            raise ValueError("HF config mapping has no model_type field")
        return AutoConfig.for_model(config.pop("model_type"), **config)
    return hf_config


def gpt_config_from_hf(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    recompute: str = "none",
    ep: int = 1,
    overrides: Mapping[str, Any] | None = None,
) -> GPTConfig:
    """Translate an HF Qwen2 / Llama / Qwen3 config (PretrainedConfig or config.json dict) for megatron-core.

    dtype defaults to bf16 with CUDA and fp32 on the CPU (params_dtype, pipeline_dtype and the bf16
    flag follow it); weights are initialised on the CPU when there is no CUDA. `overrides` sets
    further TransformerConfig fields (e.g. recompute_granularity, variable_seq_lengths). Raises
    ValueError naming the field for an unsupported architecture, setting or override, and for
    a TP/PP split the model does not allow (`validate_model_split`).

    `sequence_parallel` (needs tp > 1) splits the sequence dimension of the activations outside the TP regions
    over the TP ranks (megatron's sequence parallelism); `recompute` is a key of `RECOMPUTE_SETTINGS`
    (``parallel.recompute``). A mixture-of-experts model (Qwen3-MoE) splits its experts over ``ep`` ranks
    (``parallel.expert``; `grpo_mega.model.moe_config.moe_fields`); ``ep`` > 1 for a dense model is an error.
    """
    hf = _as_hf_config(hf_config)
    _check_supported(hf)
    family = FAMILIES[hf.model_type]
    if ep != 1 and not family.moe:
        raise ValueError(f"parallel.expert={ep}: a {hf.model_type} model has no experts to split (use 1)")
    if family.moe and ep % tp != 0:
        raise ValueError(f"a {hf.model_type} model at parallel.tensor={tp} needs parallel.expert to be a multiple of "
                         f"{tp} (got {ep}): its experts, whole on each rank, are split over whole tensor-parallel "
                         f"groups (with fewer expert ranks than TP ranks the experts' gradients do not match a TP=1 "
                         f"step's)")
    fields: dict[str, Any] = {}
    for hf_name, mcore_name, required in HF_TO_MCORE_FIELDS:
        value = getattr(hf, hf_name, None)
        if value is None:
            if required:
                raise ValueError(f"{hf.model_type} config is missing required field {hf_name}")
            continue
        fields[mcore_name] = value
    validate_model_split(
        tp,
        pp,
        fields["num_layers"],
        fields["num_attention_heads"],
        fields.get("num_query_groups", fields["num_attention_heads"]),
    )
    has_cuda = get_device().type == "cuda"  # parallel.device=cpu builds on the CPU even on a GPU node
    dtype = dtype or (torch.bfloat16 if has_cuda else torch.float32)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    fields.update(
        FAMILY_SETTINGS,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not has_cuda,
        sequence_parallel=sequence_parallel,
    )
    if sequence_parallel and tp < 2:
        raise ValueError("sequence_parallel needs tensor parallelism (tp > 1), got tp=1")
    if recompute not in RECOMPUTE_SETTINGS:
        raise ValueError(f"recompute={recompute!r}: expected one of {tuple(RECOMPUTE_SETTINGS)}")
    fields.update(RECOMPUTE_SETTINGS[recompute])
    if family.moe:
        fields.update(moe_fields(hf, ep=ep))
    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    for name in overrides or {}:
        if name not in known:
            raise ValueError(f"override {name!r} is not a TransformerConfig field")
    fields.update(overrides or {})
    rotary_base, rope_scaling_factor = _rope_settings(hf)
    return GPTConfig(
        transformer=TransformerConfig(**fields),
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        padded_vocab_size=padded_vocab_size(hf.vocab_size, tp),
        max_sequence_length=hf.max_position_embeddings,
        rotary_base=rotary_base,
        rope_scaling_factor=rope_scaling_factor,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def _is_moe(model_type: str | None) -> bool:
    family = FAMILIES.get(model_type)
    return family is not None and family.moe


def tools_expert_parallel(hf_config: Any, tp: int) -> int:
    """The expert-parallel size a conversion or comparison tool runs a model at: a mixture-of-experts model's
    experts over its TP ranks (``parallel.expert`` = ``parallel.tensor``), 1 for a dense model."""
    return tp if _is_moe(getattr(hf_config, "model_type", None)) else 1


def load_model_hf_config(model_cfg: Any) -> Any:
    """The transformers config of a run's model (``model.hf_config``), with ``model.moe_aux_loss_coeff`` in place of
    a mixture-of-experts config's ``router_aux_loss_coef`` when it is set (the run config's choice of the
    load-balancing loss weight; the folder's config.json, which exports copy, is left as it is)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_cfg.hf_config)
    coeff = getattr(model_cfg, "moe_aux_loss_coeff", None)
    if coeff is not None:
        if not _is_moe(hf.model_type):
            raise ValueError(f"model.moe_aux_loss_coeff={coeff}: {model_cfg.hf_config} is a {hf.model_type} model "
                             f"without experts")
        hf.router_aux_loss_coef = float(coeff)
    return hf
