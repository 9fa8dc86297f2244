"""Apply a reward function to a batch of completions, refusing anything that is not a finite number."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import torch

from grpo_mega.reward.registry import RewardFunction

_PROMPT_PREVIEW_CHARS = 80


class RewardError(RuntimeError):
    """A reward function raised, or returned something other than a finite number, for one sample."""


def _preview(prompt: str) -> str:
    return repr(prompt if len(prompt) <= _PROMPT_PREVIEW_CHARS else prompt[:_PROMPT_PREVIEW_CHARS] + "...")


def _as_float(value: Any) -> float | None:
    """A finite float from a Python/NumPy number or a one-element tensor; None for anything else."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def compute_rewards(
    fn: RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    extras: Sequence[Mapping[str, Any]] | None = None,
) -> torch.Tensor:
    """Float32 tensor [B] with ``fn(prompts[i], completions[i], answers[i], **extras[i])`` for each sample i.

    A call that raises, or returns NaN, infinity or a non-number, raises RewardError naming the sample index and
    (truncated) prompt, so a broken user function fails loudly instead of silently poisoning the advantages.
    """
    size = len(completions)
    if len(prompts) != size or len(answers) != size or (extras is not None and len(extras) != size):
        raise ValueError(
            f"compute_rewards: batch sizes differ: {len(prompts)} prompts, {size} completions, {len(answers)} answers"
            + (f", {len(extras)} extras" if extras is not None else "")
        )
    name = getattr(fn, "__qualname__", repr(fn))
    rewards = []
    for i in range(size):
        extra = dict(extras[i]) if extras is not None else {}
        try:
            value = fn(prompts[i], completions[i], answers[i], **extra)
        except Exception as error:
            raise RewardError(
                f"reward function {name} raised on sample {i} (prompt {_preview(prompts[i])}): {error!r}"
            ) from error
        number = _as_float(value)
        if number is None:
            raise RewardError(
                f"reward function {name} returned {value!r} for sample {i} (prompt {_preview(prompts[i])}); "
                "expected a finite number"
            )
        rewards.append(number)
    return torch.tensor(rewards, dtype=torch.float32)
