"""``model.lora``: low-rank adapters on the policy's linear layers, named as Megatron-Bridge's
``megatron.bridge.peft.lora.LoRA`` names them (``dim`` is our ``rank``). The adapters themselves:
``grpo_mega.lora`` (Megatron engine), ``grpo_mega.engine.deepspeed_lora`` (DeepSpeed engine, peft's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_mega.checkpoint.lora_names import HF_TARGET_NAMES, LORA_TARGETS  # noqa: F401 (re-exported)


@dataclass
class LoRAConfig:
    """Low-rank adaptation (LoRA, Hu et al. 2021): each target linear W (out x in) keeps its weights frozen and
    learns W + (alpha / rank) * B A, with A (rank x in) and B (out x rank); B starts at zero, so step 0 is the base
    model. The optimizer holds only A and B; the KL reference is the base (the adapters off, no second model);
    the weights synced to the rollout engine are merged; checkpoints hold the adapters only. ``grpo-mega train``
    (GRPO) on either engine (``engine: deepspeed``: peft's LoRA layers on the HF model, one A per HF linear) and
    ``grpo-mega prm train`` on the Megatron engine (a classifier PRM's head trained whole beside the adapters)."""

    rank: int = 0
    """Rank r of the adapters; 0 (default) = LoRA off, every weight trained. RL needs little: 8-32 is usual (verl's
    ``lora_rank``, TRL/peft's ``r``, Megatron-Bridge's ``dim``)."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (verl's ``lora_alpha``, peft's
    ``lora_alpha``, Megatron-Bridge's ``alpha``; Bridge's default 32)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (peft's ``lora_dropout``; Bridge's ``dropout``, position
    ``pre``); forward passes without gradients (old and reference log-probs) never drop."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Which linear layers of every transformer layer take an adapter: any of ``linear_qkv``, ``linear_proj``,
    ``linear_fc1``, ``linear_fc2`` (default: all four, as Bridge; verl's ``target_modules: all-linear``). On a
    mixture-of-experts model only ``linear_qkv`` and ``linear_proj`` (the experts take none)."""

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of B A."""
        return self.alpha / self.rank
