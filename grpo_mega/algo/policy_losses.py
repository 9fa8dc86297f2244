"""The policy-gradient surrogates of ``algorithm.policy_loss`` beyond PPO's token clip: GSPO, GSPO-token, GMPO and
CISPO, and the one registry of every form (:data:`POLICY_LOSS_FORMS`, :func:`compute_policy_loss`).

Every form maps ``(logp, old_logp, advantages, mask)`` ([B, T]; advantages [B, T] or [B]; row i is sequence i) to a
per-token loss [B, T] that :func:`~grpo_mega.algo.losses.aggregate_loss` reduces. A sequence-level form puts its
sequence's loss l_i on every token of the sequence, so ``seq-mean-token-mean`` (``sum_i (sum_t l_i m_it / n_i) / S``)
gives the paper's ``(1/S) sum_i l_i``; their ratio needs every token of a sequence, which a micro-batch always has
(rows are never split; packed micro-batches hand the loss their rows back). Metrics are masked token means, detached:
``clipfrac`` (tokens whose clip bound is what the loss took) and ``approx_kl`` (``mean(old_logp - logp)``).
"""

from __future__ import annotations

from typing import Callable

import torch

from grpo_mega.algo.choices import POLICY_LOSSES
from grpo_mega.algo.losses import _MAX_LOG_RATIO, _masked_mean, policy_loss

_SAME_ADVANTAGE_RTOL = 1e-5


def _check_clip(name: str, clip_low: float | None, clip_high: float) -> None:
    if (clip_low is not None and clip_low < 0) or clip_high < 0:
        raise ValueError(f"{name}: clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")


def _token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor, form: str) -> torch.Tensor:
    """The one advantage A_i of each sequence [B]: ``advantages`` [B], or [B, T] whose masked tokens of a row all
    carry the same value. ValueError naming the first row whose tokens differ (process supervision's per-token
    credit, which ``form`` is not defined for)."""
    if advantages.dim() == 1:
        return advantages
    lengths = mask.sum(dim=-1)
    mean = (advantages * mask).sum(dim=-1) / lengths.clamp(min=1)
    spread = ((advantages - mean[:, None]).abs() * mask).amax(dim=-1)
    differs = spread > _SAME_ADVANTAGE_RTOL * (1 + mean.abs())
    if differs.any():
        row = int(differs.nonzero()[0, 0])
        values = advantages[row][mask[row] > 0]
        raise ValueError(
            f"policy_loss={form} needs one advantage per sequence, but row {row}'s tokens carry advantages from "
            f"{values.min().item():.6g} to {values.max().item():.6g} (process supervision); use gspo_token or cispo"
        )
    return mean


def _sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(1/n_i) sum_t m_it (logp_it - old_logp_it)`` [B], clamped to +-_MAX_LOG_RATIO (finite exp)."""
    mean = ((logp - old_logp) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return mean.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _metrics(clipped: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    with torch.no_grad():
        return {"clipfrac": _masked_mean(clipped.to(logp.dtype), mask),
                "approx_kl": _masked_mean(old_logp - logp, mask)}


def gspo_loss(logp, old_logp, advantages, mask, *, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one length-normalised ratio per sequence.

    ``s_i = exp((1/n_i) sum_t m_it (logp_it - old_logp_it))`` (the geometric mean of the token ratios);
    ``l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))`` on every token of sequence i (one clip
    decision per sequence; the gradient flows through s_i: ``d l_i / d logp_it = -A_i s_i / n_i`` unclipped).
    ``A_i``: one advantage per sequence (:func:`sequence_advantages`). Paper clip range 3e-4 / 4e-4.
    """
    _check_clip("gspo", clip_low, clip_high)
    mask = mask.to(logp.dtype)
    adv = sequence_advantages(advantages, mask, "gspo")[:, None]
    ratio = torch.exp(_sequence_log_ratio(logp, old_logp, mask))[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped).expand_as(logp)
    return loss, _metrics((clipped > unclipped).expand_as(logp), logp, old_logp, mask)


def gspo_token_loss(logp, old_logp, advantages, mask, *, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO-token (arXiv 2507.18071, sec. 4.3): the sequence ratio with a token's own gradient path.

    ``s_it = sg[s_i] * pi_it / sg[pi_it] = exp(sg[log s_i] + logp_it - sg[logp_it])`` (value s_i, gradient
    ``d s_it / d logp_it = s_i``); ``l_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high))``.
    Per-token advantages are allowed; with one A_i per sequence, ``seq-mean-token-mean`` of l_it has GSPO's value
    and gradient. Paper clip range 3e-4 / 4e-4 (as GSPO's).
    """
    _check_clip("gspo_token", clip_low, clip_high)
    mask = mask.to(logp.dtype)
    adv = _token_advantages(advantages)
    log_ratio = _sequence_log_ratio(logp.detach(), old_logp, mask)[:, None] + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, _metrics(clipped > unclipped, logp, old_logp, mask)


def gmpo_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.4, clip_high: float = 0.4):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl's ``geo_mean``): the geometric mean of clipped token ratios.

    With ``d_it = logp_it - old_logp_it`` and ``c_it = clamp(d_it, -clip_low, clip_high)`` (a clip in log space),
    the pessimistic token log-ratio is ``min(d_it, c_it)`` for ``A_i >= 0`` and ``max(d_it, c_it)`` for ``A_i < 0``;
    ``l_i = -A_i exp((1/n_i) sum_t m_it * that)`` on every token of sequence i, i.e. the paper's
    ``-(prod_t |min(r_it A_i, clip(r_it) A_i)|)^(1/n_i) sgn(A_i)``. ``A_i``: one advantage per sequence (the
    geometric mean of terms needs their one sign). Paper / verl README clip: +-0.4.
    """
    _check_clip("gmpo", clip_low, clip_high)
    mask = mask.to(logp.dtype)
    adv = sequence_advantages(advantages, mask, "gmpo")[:, None]
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    bounded = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = torch.where(adv >= 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    seq_log_ratio = (pessimistic * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    loss = (-adv * torch.exp(seq_log_ratio)).expand_as(logp)
    return loss, _metrics(pessimistic != log_ratio, logp, old_logp, mask)


def cispo_loss(logp, old_logp, advantages, mask, *, clip_low: float | None = None, clip_high: float = 4.0):
    """CISPO (MiniMax-M1, arXiv 2506.13585): a clipped, detached importance weight on log pi.

    ``r_it = exp(logp_it - old_logp_it)``; ``w_it = sg(clip(r_it, 1 - clip_low, 1 + clip_high))`` (no lower bound
    for ``clip_low=None``, as MiniMax-M1 runs it); ``l_it = -w_it A_it logp_it``. Every token keeps its gradient
    ``-w_it A_it`` (PPO's clip zeroes it outside the range). The paper publishes no upper value; 4.0 (a weight of at
    most 5) is ScaleRL's cap, which TRL and slime use.
    """
    _check_clip("cispo", clip_low, clip_high)
    mask = mask.to(logp.dtype)
    adv = _token_advantages(advantages)
    with torch.no_grad():
        ratio = torch.exp((logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        weight = ratio.clamp(None if clip_low is None else 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logp
    return loss, _metrics(weight != ratio, logp, old_logp, mask)


POLICY_LOSS_FORMS: dict[str, Callable] = {
    "ppo": policy_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "gmpo": gmpo_loss,
    "cispo": cispo_loss,
}
"""Every ``algorithm.policy_loss`` form: ``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high)`` ->
``(per-token loss [B, T], metrics)`` (``ppo`` also takes ``dual_clip``)."""
assert tuple(POLICY_LOSS_FORMS) == POLICY_LOSSES


def compute_policy_loss(form: str, logp, old_logp, advantages, mask, *, clip_low, clip_high,
                        dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss and metrics of ``form`` (:data:`POLICY_LOSS_FORMS`); ``dual_clip`` is PPO's alone."""
    if form not in POLICY_LOSS_FORMS:
        raise ValueError(f"unknown policy_loss={form!r}; expected one of {POLICY_LOSSES}")
    if form == "ppo":
        return policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                           dual_clip=dual_clip)
    if dual_clip is not None:
        raise ValueError(f"dual_clip applies to policy_loss=ppo only, not {form}")
    return POLICY_LOSS_FORMS[form](logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high)
