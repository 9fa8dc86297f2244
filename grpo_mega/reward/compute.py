"""Apply a reward function to completions: one validated result per sample, per-step rewards included.

A reward function returns a number (the completion's reward) or :class:`StepRewards` (the completion's reward and
one reward per reasoning step). Anything else, NaN, infinity, or an exception, is a failure of that sample:
``on_error="raise"`` stops with a :class:`RewardError` naming the sample; ``on_error="zero"`` gives the sample
reward 0 (no steps) and counts it, so one flaky verifier call cannot kill a week-long run.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from grpo_mega.reward.types import RewardFunction, SampleReward, StepRewards, TurnRewards, WeightedScore

if TYPE_CHECKING:
    import torch

_PROMPT_PREVIEW_CHARS = 80
ON_ERROR_CHOICES = ("zero", "raise")


class RewardError(RuntimeError):
    """A reward function raised, or returned something other than a finite number, for one sample."""


def _preview(prompt: str) -> str:
    return repr(prompt if len(prompt) <= _PROMPT_PREVIEW_CHARS else prompt[:_PROMPT_PREVIEW_CHARS] + "...")


def _as_float(value: Any) -> float | None:
    """A finite float from a Python/NumPy number or a one-element tensor; None for anything else. (A tensor exists
    only once torch is imported: this module does not import it, so the CLI's pre-launch check of a reward function,
    ``grpo_mega.config.preflight``, runs without torch's import.)"""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def check_result(value: Any, text_length: int) -> SampleReward | str:
    """A SampleReward from a reward function's return value, or the reason it is unusable."""
    if isinstance(value, StepRewards):
        score = _as_float(value.score)
        steps = [_as_float(r) for r in value.step_rewards]
        ends = list(value.step_ends)
        if score is None or any(s is None for s in steps):
            return "expected a finite score and finite step rewards"
        if len(steps) != len(ends):
            return f"expected as many step ends as step rewards, got {len(ends)} and {len(steps)}"
        if any(not isinstance(e, int) or not 0 < e <= text_length for e in ends) or ends != sorted(set(ends)):
            return f"expected step ends strictly increasing in (0, {text_length}]"
        return SampleReward(score, steps, ends)
    if isinstance(value, TurnRewards):
        score = _as_float(value.score)
        turns = [_as_float(r) for r in value.turn_rewards]
        if score is None or any(r is None for r in turns):
            return "expected a finite score and finite turn rewards"
        return SampleReward(score, turn_rewards=turns)
    if value is None:
        return "expected a finite number or StepRewards (None: no reward function applies to it, TRL's convention)"
    number = _as_float(value)
    if number is None:
        return "expected a finite number or StepRewards"
    return SampleReward(number, components=dict(value.components) if isinstance(value, WeightedScore) else None)


def component_metrics(results: Sequence[SampleReward]) -> dict[str, float]:
    """``reward/<name>/mean`` of each reward function of a weighted sum (``reward.functions``) over the samples it
    applied to (its value not None; a failed sample has none), as TRL logs ``rewards/<name>/mean``; {} for one
    function. The value is the function's own, before its weight."""
    values: dict[str, list[float]] = {}
    for result in results:
        for name, value in (result.components or {}).items():
            values.setdefault(name, [])
            if value is not None:
                values[name].append(value)
    return {f"reward/{name}/mean": sum(found) / len(found) for name, found in values.items() if found}


def score_sample(
    fn: RewardFunction, index: int, prompt: str, completion: str, answer: str | None,
    extra: Mapping[str, Any] | None, *, on_error: str = "raise",
) -> SampleReward:
    """``fn(prompt, completion, answer, **extra)`` validated; ``index`` only names the sample in errors."""
    _check_on_error(on_error)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        value = fn(prompt, completion, answer, **dict(extra or {}))
    except Exception as error:
        message = f"reward function {name} raised on sample {index} (prompt {_preview(prompt)}): {error!r}"
        if on_error == "raise":
            raise RewardError(message) from error
        return SampleReward(0.0, failed=True, error=message)
    return _checked(name, index, prompt, completion, value, on_error)


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"reward.on_error={on_error!r}: expected one of {ON_ERROR_CHOICES}")


def _checked(name: str, index: int, prompt: str, completion: str, value: Any, on_error: str) -> SampleReward:
    """The SampleReward of a reward function's return ``value``, or its failure (raised under ``on_error="raise"``)."""
    try:
        result = check_result(value, len(completion))
    except Exception as error:  # a StepRewards whose fields are not sequences
        result = f"{error!r}"
    if isinstance(result, SampleReward):
        return result
    message = f"reward function {name} returned {value!r} for sample {index} (prompt {_preview(prompt)}); {result}"
    if on_error == "raise":
        raise RewardError(message)
    return SampleReward(0.0, failed=True, error=message)


def score_samples(
    fn: RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    extras: Sequence[Mapping[str, Any]] | None = None,
    *,
    on_error: str = "raise",
    indices: Sequence[int] | None = None,
) -> list[SampleReward]:
    """:func:`score_sample` for every sample; ``indices`` (default 0..B-1) name the samples in errors."""
    size = len(completions)
    if len(prompts) != size or len(answers) != size or (extras is not None and len(extras) != size):
        raise ValueError(
            f"reward: batch sizes differ: {len(prompts)} prompts, {size} completions, {len(answers)} answers"
            + (f", {len(extras)} extras" if extras is not None else "")
        )
    indices = range(size) if indices is None else indices
    batch = getattr(fn, "score_batch", None)
    if batch is not None and size:  # TRL's form: the whole batch in one call, as TRL calls it
        _check_on_error(on_error)
        try:
            values = batch(prompts, completions, answers, [dict(extras[i] or {}) if extras else {} for i in range(size)])
        except Exception:  # called again one sample at a time below, which names the sample that fails
            values = None
        if values is not None:
            name = getattr(fn, "__qualname__", repr(fn))
            return [_checked(name, indices[i], prompts[i], completions[i], values[i], on_error) for i in range(size)]
    return [
        score_sample(fn, indices[i], prompts[i], completions[i], answers[i], extras[i] if extras else None,
                     on_error=on_error)
        for i in range(size)
    ]


def compute_rewards(
    fn: RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    extras: Sequence[Mapping[str, Any]] | None = None,
) -> torch.Tensor:
    """Float32 tensor [B] of the score of ``fn(prompts[i], completions[i], answers[i], **extras[i])``.

    A call that raises, or returns NaN, infinity or a non-number, raises RewardError naming the sample index and
    (truncated) prompt, so a broken user function fails loudly instead of silently poisoning the advantages.
    """
    import torch

    results = score_samples(fn, prompts, completions, answers, extras, on_error="raise")
    return torch.tensor([r.score for r in results], dtype=torch.float32)
