"""Rewards: rule verifiers (math answers, formats, the synthetic task), user functions by import path."""

from grpo_mega.reward.compute import RewardError, compute_rewards
from grpo_mega.reward.registry import REWARD_FUNCTIONS, RewardFunction, get_reward_function

__all__ = ["REWARD_FUNCTIONS", "RewardError", "RewardFunction", "compute_rewards", "get_reward_function"]
