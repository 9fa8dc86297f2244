"""Reward and advantage shaping used by ROLL-style GRPO configs: clipping and whitening."""

from __future__ import annotations

import torch


def clip_rewards(rewards: torch.Tensor, bound: float) -> torch.Tensor:
    """Clamp rewards to ``[-bound, bound]`` (ROLL's reward_clip)."""
    if bound <= 0:
        raise ValueError(f"reward clip bound must be > 0, got {bound}")
    return rewards.clamp(-bound, bound)


def clip_advantages(advantages: torch.Tensor, bound: float) -> torch.Tensor:
    """Clamp advantages to ``[-bound, bound]`` (ROLL's advantage_clip)."""
    if bound <= 0:
        raise ValueError(f"advantage clip bound must be > 0, got {bound}")
    return advantages.clamp(-bound, bound)


def whiten(
    values: torch.Tensor, mask: torch.Tensor | None = None, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten over the batch: ``(x - mean) / sqrt(var + eps)`` over the entries where ``mask`` is set.

    ``var`` is the unbiased masked variance. With ``shift_mean=False`` the mean is added back (scale only).
    Masked-out entries are returned as 0.
    """
    if mask is None:
        mask = torch.ones_like(values)
    mask = mask.to(values.dtype)
    count = mask.sum()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 unmasked values, got {int(count)}")
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward term <= 0 per completion.

    With ``start = max_length - buffer``: 0 for ``L <= start``, ``-factor * (L - start) / buffer`` up to
    ``max_length`` (so ``-factor`` at the limit).
    """
    if buffer <= 0 or buffer >= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}), got {buffer}")
    start = max_length - buffer
    excess = (response_lengths.to(torch.float32) - start).clamp(min=0, max=buffer)
    return -factor * excess / buffer
