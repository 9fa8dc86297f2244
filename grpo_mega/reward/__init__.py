"""Rewards: rule verifiers (math answers, formats, the synthetic task), user functions by import path.

A reward function is ``fn(prompt, completion, answer, **extra)`` returning a float, or :class:`StepRewards` (the
completion's reward plus one reward per reasoning step, each with the character offset where the step ends).

It may import ``data`` (the synthetic task, answer formats); the stages, the PRM and the commands import it.
"""

from grpo_mega.reward.compute import ON_ERROR_CHOICES, RewardError, compute_rewards, score_samples
from grpo_mega.reward.distributed import score_across_ranks
from grpo_mega.reward.registry import REWARD_FUNCTIONS, get_reward_function
from grpo_mega.reward.types import RewardFunction, SampleReward, StepRewards, TurnRewards

__all__ = [
    "ON_ERROR_CHOICES",
    "REWARD_FUNCTIONS",
    "RewardError",
    "RewardFunction",
    "SampleReward",
    "StepRewards",
    "TurnRewards",
    "compute_rewards",
    "get_reward_function",
    "score_across_ranks",
    "score_samples",
]
