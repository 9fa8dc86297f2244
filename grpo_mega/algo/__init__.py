"""Pure GRPO math: advantages, the clipped policy loss, KL estimators, loss aggregation, reward shaping, step rewards
from PRM scores, and the
sampler/trainer mismatch (log-prob differences, truncated importance sampling).

Functions of tensors only: no process groups, no model. Every later part (trainer, PRM, engines) calls these.

It may import torch and the standard library only, nothing of grpo_mega or prm: every other package may
import it.
"""

from grpo_mega.algo.advantages import (STEP_BASELINES, completion_baseline_advantages, normalize_step_rewards,
                                      outcome_advantages, process_advantages)
from grpo_mega.algo.answer_credit import cut_at_answer
from grpo_mega.algo.kl import DEFAULT_LOG_RATIO_CLAMP, KL_ESTIMATORS, kl_estimate
from grpo_mega.algo.losses import LOSS_AGG_MODES, aggregate_loss, policy_loss
from grpo_mega.algo.rollout_correction import rollout_logprob_diff, truncated_importance_weights
from grpo_mega.algo.shaping import clip_advantages, clip_rewards, overlong_penalty, whiten
from grpo_mega.algo.step_rewards import STEP_REWARDS, group_start_values, step_rewards_from_scores
from grpo_mega.algo.tree_values import path_values, tree_node_values

__all__ = [
    "DEFAULT_LOG_RATIO_CLAMP",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "STEP_BASELINES",
    "STEP_REWARDS",
    "aggregate_loss",
    "clip_advantages",
    "clip_rewards",
    "completion_baseline_advantages",
    "cut_at_answer",
    "group_start_values",
    "kl_estimate",
    "normalize_step_rewards",
    "outcome_advantages",
    "overlong_penalty",
    "path_values",
    "policy_loss",
    "process_advantages",
    "rollout_logprob_diff",
    "step_rewards_from_scores",
    "tree_node_values",
    "truncated_importance_weights",
    "whiten",
]
