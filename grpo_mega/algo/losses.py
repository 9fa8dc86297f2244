"""The clipped policy-gradient loss (PPO / GRPO, with clip-higher and dual clip) and loss aggregation."""

from __future__ import annotations

import torch

from grpo_mega.algo.choices import LOSS_AGG_MODES

# exp(20) ~ 5e8: keeps the ratio finite when the policy has moved far from the sampler (same bound as verl).
_MAX_LOG_RATIO = 20.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss.

    ``rho = exp(logp - old_logp)``;
    ``l = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))`` (``clip_high > clip_low`` is DAPO's
    clip-higher); with ``dual_clip = c > 1``, for ``A < 0``: ``l = min(l, -A * c)`` (bounds the loss of tokens whose
    ratio exploded on a negative advantage).

    Args:
        logp, old_logp, mask: [B, T]. advantages: [B, T] or [B] (broadcast over tokens).
    Returns:
        ``(per_token_loss [B, T], metrics)`` with metrics (masked token means, detached): ``clipfrac`` (tokens where
        the clipped term was taken), ``approx_kl`` (``mean(old_logp - logp)``, verl's ppo_kl) and
        ``dual_clipfrac``.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds -A * rho at -A * c), got {dual_clip}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_taken = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_taken = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_taken, bound.expand_as(loss), loss)
    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean((clipped > unclipped).to(logp.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "dual_clipfrac": _masked_mean(dual_taken.to(logp.dtype), mask),
        }
    return loss, metrics


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    norm_length: float | None = None,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    With ``m`` the mask, ``L_i = sum_t l_{i,t} m_{i,t}``, ``n_i = sum_t m_{i,t}``, ``N = sum_i n_i`` and
    ``S`` the number of sequences with at least one token:

    - ``token-mean``: ``sum_i L_i / N``
    - ``seq-mean-token-mean``: ``sum_i (L_i / n_i) / S``
    - ``seq-mean-token-sum``: ``sum_i L_i / S``
    - ``seq-mean-token-sum-norm``: ``sum_i L_i / (S * norm_length)`` (Dr. GRPO: a constant length, not n_i)

    ``N`` and ``S`` are counted over the whole global batch when ``global_tokens`` / ``global_seqs`` are given: a
    training step that splits the batch into micro-batches (and data-parallel ranks) passes the global counts so
    the summed micro-batch losses equal the loss of the whole batch, whatever the micro-batch size.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode={mode!r}; expected one of {LOSS_AGG_MODES}")
    mask = mask.to(per_token_loss.dtype)
    seq_sums = (per_token_loss * mask).sum(dim=-1)
    seq_lengths = mask.sum(dim=-1)
    num_tokens = global_tokens if global_tokens is not None else seq_lengths.sum().clamp(min=1)
    num_seqs = global_seqs if global_seqs is not None else (seq_lengths > 0).sum().clamp(min=1)
    if mode == "token-mean":
        return seq_sums.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (seq_sums / seq_lengths.clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if norm_length is None or norm_length <= 0:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs norm_length > 0 (e.g. response_length)")
    return seq_sums.sum() / (num_seqs * norm_length)
