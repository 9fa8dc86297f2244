"""The GRPO loss as a :data:`~grpo_mega.engine.base.LossFn`: policy loss + KL + entropy bonus on one micro-batch.

All math comes from :mod:`grpo_mega.algo`; this module only wires the batch fields to it and turns per-micro-batch
means into shares of the global batch (so the step is independent of how the batch is split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_mega.algo import (
    DEFAULT_LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    SEQUENCE_LEVEL_POLICY_LOSSES,
    aggregate_loss,
    compute_policy_loss,
    kl_estimate,
    rollout_logprob_diff,
    truncated_importance_weights,
)
from grpo_mega.engine.base import LossScale

ROLLOUT_IS_MODES = ("none", "tis")


@dataclass(frozen=True)
class GRPOLossSettings:
    policy_loss: str = "ppo"
    """The surrogate (``grpo_mega.algo.policy_losses``): ``ppo``, ``gspo``, ``gspo_token``, ``gmpo``, ``cispo``."""
    clip_low: float | None = 0.2
    """The clip range of ``policy_loss``, as its function takes it (``cispo``: None = no lower bound)."""
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg_mode: str = "token-mean"
    norm_length: float | None = None
    kl_coef: float = 0.0
    """0 disables the KL term (``use_kl_loss: false``)."""
    kl_estimator: str = "k3"
    kl_log_ratio_clamp: float | None = DEFAULT_LOG_RATIO_CLAMP
    """``ref_logp - logp`` is clamped to +-this before the KL estimator (None: no clamp)."""
    entropy_coef: float = 0.0
    on_policy: bool = False
    """The policy has not moved since sampling (one update per rollout batch): old log-probs are the current
    ones, detached, so the ratio is exactly 1 and no extra forward pass is spent on them."""
    rollout_is: str = "none"
    """Sampler/trainer mismatch correction: ``none``, or ``tis`` (truncated importance sampling: each token's
    policy loss is multiplied by ``min(exp(old_logp - rollout_logp), rollout_is_cap)``, detached)."""
    rollout_is_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss={self.policy_loss!r}; expected one of {POLICY_LOSSES}")
        if self.policy_loss in SEQUENCE_LEVEL_POLICY_LOSSES and self.loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(f"policy_loss={self.policy_loss} is a sequence-level loss: it needs "
                             f"loss_agg_mode='seq-mean-token-mean', got {self.loss_agg_mode!r}")
        if self.rollout_is not in ROLLOUT_IS_MODES:
            raise ValueError(f"rollout_is={self.rollout_is!r}; expected one of {ROLLOUT_IS_MODES}")
        if not self.rollout_is_cap > 0:
            raise ValueError(f"rollout_is_cap must be > 0, got {self.rollout_is_cap}")


def grpo_loss_fn(settings: GRPOLossSettings):
    """Build ``loss_fn(head_outputs, micro_batch, scale)`` for the engine.

    Reads ``loss_mask``, ``advantages`` [B, L], ``old_logprobs`` (unless ``on_policy``), (with KL)
    ``ref_logprobs`` and (with ``rollout_is="tis"``) ``rollout_logprobs`` (the sampler's) from the micro-batch;
    ``head_outputs`` holds ``logprobs`` and ``entropy``.
    ``loss = aggregate(w * l_pg + kl_coef * kl - entropy_coef * entropy)`` over the global batch, ``l_pg`` the
    per-token loss of ``settings.policy_loss`` (a sequence-level form's l_i on each of its tokens), with ``w = 1``
    or, with TIS, ``w = min(exp(old_logp - rollout_logp), rollout_is_cap)`` (no gradient through ``w``; the KL
    and entropy terms are not weighted, as in verl).
    """

    def loss_fn(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor], scale: LossScale):
        logp, entropy = outputs["logprobs"], outputs["entropy"]
        mask = micro["loss_mask"].to(logp.dtype)
        old_logp = logp.detach() if settings.on_policy else micro["old_logprobs"].to(logp.dtype)
        per_token, pg_metrics = compute_policy_loss(
            settings.policy_loss,
            logp,
            old_logp,
            micro["advantages"].to(logp.dtype),
            mask,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            dual_clip=settings.dual_clip,
        )
        tis_weights = None
        if settings.rollout_is == "tis":
            if "rollout_logprobs" not in micro:
                raise KeyError("rollout_is='tis' needs the sampler's log-probs: micro-batch field 'rollout_logprobs'")
            tis_weights = truncated_importance_weights(old_logp, micro["rollout_logprobs"], settings.rollout_is_cap)
            per_token = per_token * tis_weights
        aggregate = dict(
            mode=settings.loss_agg_mode,
            norm_length=settings.norm_length,
            global_tokens=scale.global_tokens,
            global_seqs=scale.global_seqs,
        )
        pg_loss = aggregate_loss(per_token, mask, **aggregate)
        loss = pg_loss
        token_share = mask.sum() / scale.global_tokens
        metrics = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": pg_metrics["clipfrac"] * token_share,
            "actor/ppo_kl": pg_metrics["approx_kl"] * token_share,
            "actor/entropy": (entropy.detach() * mask).sum() / scale.global_tokens,
        }
        if "dual_clipfrac" in pg_metrics:  # ppo's dual clip (verl's name)
            metrics["actor/pg_clipfrac_lower"] = pg_metrics["dual_clipfrac"] * token_share
        if settings.on_policy and "rollout_logprobs" in micro:
            # The logits of this forward pass are the ones that sampled: the sampler/trainer mismatch costs no
            # extra pass. Means are shares of the global batch; ``*_max`` metrics are reduced by max (the engine).
            for name, value in rollout_logprob_diff(logp, micro["rollout_logprobs"].to(logp.dtype), mask).items():
                metrics[name] = value if name.endswith("_max") else value * token_share
        if tis_weights is not None:
            capped = (tis_weights >= settings.rollout_is_cap).to(mask.dtype)
            metrics["actor/tis_weight_mean"] = (tis_weights * mask).sum() / scale.global_tokens
            metrics["actor/tis_clipfrac"] = (capped * mask).sum() / scale.global_tokens
        if settings.kl_coef:
            kl = kl_estimate(
                logp,
                micro["ref_logprobs"].to(logp.dtype),
                settings.kl_estimator,
                log_ratio_clamp=settings.kl_log_ratio_clamp,
            )
            kl_loss = aggregate_loss(kl, mask, **aggregate)
            loss = loss + settings.kl_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * aggregate_loss(entropy, mask, **aggregate)
        return loss, metrics

    return loss_fn
