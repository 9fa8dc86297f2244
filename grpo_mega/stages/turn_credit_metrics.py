"""Metrics of turn credit on a trained batch (``algorithm.turn_credit``): what the turns were paid and where the
bound of ``bounded`` cut in."""

from __future__ import annotations

import torch

from grpo_mega.algo import adjusted_outcomes, normalize_step_rewards, outcome_advantages, turn_advantages
from grpo_mega.algo.turn_credit import turn_token_index
from grpo_mega.config import AlgorithmConfig
from grpo_mega.stages.rollout import RolloutBatch
from grpo_mega.stages.turn_steps import batch_turn_tensors


def turn_credit_metrics(groups: RolloutBatch, alg: AlgorithmConfig) -> dict[str, float]:
    """``turn_credit/turn_reward_mean`` (the raw turn rewards), ``turns_scored`` (turn steps in the batch),
    ``turns_per_completion``; ``flips`` (``sum``) or ``flips_avoided`` (``bounded``): the share of policy tokens of
    completions with an outcome advantage whose ``sum`` credit at the same weight has the other sign (under
    ``bounded`` none does: those are the flips its bound avoided); ``bounded`` also ``clipped_turn_fraction``, the
    turns whose weighted normalised reward exceeded the bound."""
    rewards = [r for row in groups.step_rewards for r in row]
    if not rewards:
        return {}
    G = alg.num_return_sequences_in_group
    spans, answered, stopped = batch_turn_tensors(groups.completions)
    width = spans.shape[1]
    turn_rewards = torch.zeros(len(groups.completions), width)
    for row, values in enumerate(groups.step_rewards):
        turn_rewards[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
    length = max(len(c.response_ids) for c in groups.completions)
    options = dict(answered=answered if alg.answer_guard else None, stopped_at_max_turns=stopped,
                   wrong_reward=alg.wrong_answer_reward, max_turns_outcome=alg.max_turns_outcome,
                   scale_by_std=alg.scale_by_std)
    summed = turn_advantages(groups.rewards, turn_rewards, spans, length, G, form="sum",
                             weight=alg.turn_credit_weight, **options)
    outcome = outcome_advantages(adjusted_outcomes(groups.rewards, options["answered"], stopped,
                                                   wrong_reward=alg.wrong_answer_reward,
                                                   max_turns_outcome=alg.max_turns_outcome), G,
                                 scale_by_std=alg.scale_by_std)
    counted = (turn_token_index(spans, length) >= 0) & (outcome != 0).unsqueeze(1)
    flipped = (torch.sign(summed) != torch.sign(outcome).unsqueeze(1)) & counted
    share = float(flipped.sum()) / max(int(counted.sum()), 1)
    metrics = {
        "turn_credit/turn_reward_mean": sum(rewards) / len(rewards),
        "turn_credit/turns_scored": float(len(rewards)),
        "turn_credit/turns_per_completion": len(rewards) / len(groups.completions),
        ("turn_credit/flips_avoided" if alg.turn_credit == "bounded" else "turn_credit/flips"): share,
    }
    if alg.turn_credit == "bounded":
        valid = spans[..., 0] >= 0
        z = normalize_step_rewards(turn_rewards, valid, G, scale_by_std=alg.scale_by_std)
        metrics["turn_credit/clipped_turn_fraction"] = float(
            ((alg.turn_credit_weight * z).abs() > alg.turn_credit_bound)[valid].float().mean())
    return metrics
