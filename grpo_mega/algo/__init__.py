"""Pure GRPO math: advantages, the policy losses (PPO's clip, GSPO, GSPO-token, GMPO, CISPO), KL estimators, loss
aggregation, reward shaping, step rewards from PRM scores, turn credit of multi-turn rollouts, and the sampler/trainer
mismatch (log-prob differences, truncated importance sampling).

Functions of tensors only: no process groups, no model. Every later part (trainer, PRM, engines) calls these.

It may import torch and the standard library only, nothing of grpo_mega or prm: every other package may
import it.

The names below load their module on first use (PEP 562): importing ``grpo_mega.algo.choices`` (the options' names,
which the config checks) imports no torch, so a CLI refuses a bad setting before torch's 2-3 s import.
"""

import importlib

_MODULE_OF = {
    "DEFAULT_LOG_RATIO_CLAMP": "kl",
    "KL_ESTIMATORS": "choices",
    "LOSS_AGG_MODES": "choices",
    "MAX_TURNS_OUTCOMES": "choices",
    "PER_SEQUENCE_ADVANTAGE_POLICY_LOSSES": "choices",
    "POLICY_LOSSES": "choices",
    "POLICY_LOSS_FORMS": "policy_losses",
    "SEQUENCE_LEVEL_POLICY_LOSSES": "choices",
    "STEP_BASELINES": "choices",
    "STEP_REWARDS": "choices",
    "TURN_CREDIT_FORMS": "choices",
    "adjusted_outcomes": "turn_credit",
    "aggregate_loss": "losses",
    "clip_advantages": "shaping",
    "clip_rewards": "shaping",
    "cispo_loss": "policy_losses",
    "completion_baseline_advantages": "advantages",
    "compute_policy_loss": "policy_losses",
    "cut_at_answer": "answer_credit",
    "gmpo_loss": "policy_losses",
    "group_start_values": "step_rewards",
    "gspo_loss": "policy_losses",
    "gspo_token_loss": "policy_losses",
    "kl_estimate": "kl",
    "normalize_step_rewards": "advantages",
    "outcome_advantages": "advantages",
    "overlong_penalty": "shaping",
    "path_values": "tree_values",
    "policy_loss": "losses",
    "process_advantages": "advantages",
    "rollout_logprob_diff": "rollout_correction",
    "step_rewards_from_scores": "step_rewards",
    "tree_node_values": "tree_values",
    "truncated_importance_weights": "rollout_correction",
    "turn_advantages": "turn_credit",
    "turn_node_values": "tree_values",
    "turn_tensors": "turn_credit",
    "turn_term_credit": "turn_credit",
    "turn_token_index": "turn_credit",
    "whiten": "shaping",
}
"""Each public name and the module of this package that defines it."""

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
