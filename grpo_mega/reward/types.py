"""The types a reward function deals in: its signature, per-step rewards, and one validated result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


class RewardFunction(Protocol):
    """``fn(prompt, completion, answer, **extra) -> float | StepRewards``; ``extra`` carries the dataset row's
    other fields (for example the synthetic task's ``steps``)."""

    def __call__(self, prompt: str, completion: str, answer: str, **extra) -> "float | StepRewards": ...


@dataclass(frozen=True)
class StepRewards:
    """What a reward function returns to reward each reasoning step, not just the completion.

    ``step_ends[j]`` is the character offset in the completion text where step j ends (exclusive), strictly
    increasing; the trainer maps it to the step's last response token. ``score`` is the completion's reward.
    """

    score: float
    step_rewards: Sequence[float]
    step_ends: Sequence[int]


@dataclass(frozen=True)
class TurnRewards:
    """What a reward function returns to reward each assistant turn of a multi-turn rollout
    (``process_reward.steps: turns``): ``turn_rewards[k]`` is turn k's reward, one per entry of the ``turns`` the
    function is given (``grpo_mega.stages.turn_steps.turn_views``); ``score`` is the completion's reward."""

    score: float
    turn_rewards: Sequence[float]


@dataclass(frozen=True)
class SampleReward:
    """The validated reward of one sample: its score and, when the function gave them, its step rewards."""

    score: float
    step_rewards: list[float] | None = None
    step_ends: list[int] | None = None
    turn_rewards: list[float] | None = None
    """With ``process_reward.steps: turns``: one reward per assistant turn (``TurnRewards``, or a turn source's)."""
    failed: bool = False
    error: str = field(default="", compare=False)
    components: dict[str, float | None] | None = field(default=None, compare=False)
    """With several ``reward.functions``: each function's own value (None: not applicable), by its metric name."""


class WeightedScore(float):
    """The weighted sum of several reward functions, a float, with each function's own value in ``components``
    (by its metric name), which the rollout stage logs as ``reward/<name>/mean`` (TRL's ``rewards/<name>/mean``)."""

    components: dict[str, float | None]

    def __new__(cls, total: float, components: dict[str, float | None]):
        score = super().__new__(cls, total)
        score.components = components
        return score
