"""The batch builder: advantages of a :class:`RolloutBatch` laid out on the engine's ``prompt + response`` rows.

Outcome supervision: one group-normalised reward per completion on each of its response tokens. Process
supervision: the reward function's per-step rewards, normalised over all steps of the group, and each token gets
the suffix sum of its own and later steps (``grpo_mega.algo.process_advantages``); with ``algorithm.answer_guard``
the tokens after the last step (the first final answer's end) get min(A of the answer's last token, 0). Multi-turn
rollouts with process supervision: each assistant turn is a step and the credit is ``algorithm.turn_credit``
(``grpo_mega.algo.turn_advantages``), 0 on tool tokens. Shaping
(ROLL-style) in this order: reward clip -> group normalisation -> whitening -> advantage clip. The math lives in
``grpo_mega.algo``.
"""

from __future__ import annotations

import torch

from grpo_mega.algo import (clip_advantages, clip_rewards, outcome_advantages, process_advantages, turn_advantages,
                            whiten)
from grpo_mega.config import AlgorithmConfig
from grpo_mega.data.batch import mask_response_tokens, response_values_to_tokens, routes_to_tokens, sequences_to_batch
from grpo_mega.stages.rollout import RolloutBatch
from grpo_mega.stages.turn_steps import batch_turn_tensors


def _padded(rows: list[list], fill, dtype) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def group_advantages(batch: RolloutBatch, algorithm: AlgorithmConfig) -> torch.Tensor:
    """Advantages [N, T] in response coordinates (T = longest response; 0 past each response's end and on the tool
    tokens of a multi-turn rollout, which no advantage, baseline statistic or whitening reads)."""
    G = algorithm.num_return_sequences_in_group
    lengths = torch.tensor([len(c.response_ids) for c in batch.completions])
    response_mask = (torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]).float()
    for row, completion in enumerate(batch.completions):
        if completion.response_mask is not None:  # multi-turn: tool output and template boundaries are not actions
            response_mask[row, : len(completion.response_mask)] = torch.tensor(completion.response_mask).float()
    if algorithm.supervision == "process":
        if batch.step_rewards is None:
            raise ValueError(
                "algorithm.supervision=process needs step rewards: process_reward.source=prm with a PRM, or a "
                "reward function that returns StepRewards (e.g. reward.function=synthetic_steps)"
            )
        step_rewards = _padded(batch.step_rewards, 0.0, torch.float32)
        step_ends = _padded(batch.step_ends, -1, torch.long)
        if algorithm.reward_clip is not None:
            step_rewards = clip_rewards(step_rewards, algorithm.reward_clip)
        if any(c.turns is not None for c in batch.completions):  # multi-turn: each assistant turn is a step
            advantages = turn_credit_advantages(batch, step_rewards, algorithm, response_mask.shape[1])
        else:
            advantages = process_advantages(step_rewards, step_ends, response_mask, G,
                                            scale_by_std=algorithm.scale_by_std, credit=algorithm.step_credit,
                                            after_last_step="capped" if algorithm.answer_guard else "zero",
                                            baseline=algorithm.step_baseline,
                                            min_std=algorithm.step_baseline_min_std)
        if algorithm.whiten_advantages:
            advantages = whiten(advantages, response_mask)
    else:
        rewards = batch.rewards
        if algorithm.reward_clip is not None:
            rewards = clip_rewards(rewards, algorithm.reward_clip)
        per_completion = outcome_advantages(rewards, G, scale_by_std=algorithm.scale_by_std)
        if algorithm.whiten_advantages:
            per_completion = whiten(per_completion)
        advantages = per_completion[:, None] * response_mask
    if algorithm.advantage_clip is not None:
        advantages = clip_advantages(advantages, algorithm.advantage_clip)
    return advantages * response_mask


def turn_credit_advantages(batch: RolloutBatch, turn_rewards: torch.Tensor, algorithm: AlgorithmConfig,
                           response_length: int) -> torch.Tensor:
    """[N, T] turn credit (``algorithm.turn_credit``, ``grpo_mega.algo.turn_advantages``) of a multi-turn batch whose
    step rewards are its turn steps' (``grpo_mega.stages.turn_steps``): the outcome rewards adjusted for a missing
    answer (with ``answer_guard``) and for ``max_turns`` (``max_turns_outcome``), 0 on every tool token."""
    spans, answered, stopped = batch_turn_tensors(batch.completions)
    rewards = batch.rewards
    if algorithm.reward_clip is not None:
        rewards = clip_rewards(rewards, algorithm.reward_clip)
    width = spans.shape[1]
    turn_rewards = torch.nn.functional.pad(turn_rewards, (0, max(width - turn_rewards.shape[1], 0)))[:, :width]
    return turn_advantages(rewards, turn_rewards, spans, response_length, algorithm.num_return_sequences_in_group,
                           form=algorithm.turn_credit, weight=algorithm.turn_credit_weight,
                           bound=algorithm.turn_credit_bound, answered=answered if algorithm.answer_guard else None,
                           stopped_at_max_turns=stopped, wrong_reward=algorithm.wrong_answer_reward,
                           max_turns_outcome=algorithm.max_turns_outcome, scale_by_std=algorithm.scale_by_std)


def build_training_batch(batch: RolloutBatch, algorithm: AlgorithmConfig, pad_id: int) -> dict[str, torch.Tensor]:
    """The engine batch: ``prompt + response`` rows (``grpo_mega.data.batch``), per-token ``advantages`` and the
    sampler's log-probs ``rollout_logprobs``, all aligned with ``input_ids``; with routing replay the rollout's
    ``routed_experts`` [B, L, layers, top-k] (``grpo_mega.data.batch.routes_to_tokens``). Multi-turn rollouts:
    ``loss_mask`` is their response mask on the response positions (0 on tool tokens)."""
    completions = batch.completions
    rows = sequences_to_batch([c.prompt_ids for c in completions], [c.response_ids for c in completions], pad_id)
    mask_response_tokens(rows, [c.response_mask for c in completions])
    advantages = group_advantages(batch, algorithm)
    rows["advantages"] = response_values_to_tokens(
        rows, [advantages[i, : len(c.response_ids)].tolist() for i, c in enumerate(completions)]
    )
    rows["rollout_logprobs"] = response_values_to_tokens(rows, [c.response_logprobs for c in completions])
    routed = [c.routed_experts is not None for c in completions]
    if any(routed):  # routing replay: the rollout's experts of every token, replayed by the trainer's forwards
        if not all(routed):
            raise ValueError(f"{routed.count(False)} of {len(routed)} completions came without routed_experts")
        rows["routed_experts"] = routes_to_tokens(rows, [c.routed_experts for c in completions])
    return rows
