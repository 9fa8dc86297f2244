"""From sampled completions to the GRPO training batch: rewards, dynamic-sampling filter, advantages, layout.

Each function is one stage of the data flow in ``grpo_mega.trainer``; the math itself lives in ``grpo_mega.algo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from grpo_mega.algo import clip_advantages, clip_rewards, outcome_advantages, overlong_penalty, whiten
from grpo_mega.batch import response_values_to_tokens, sequences_to_batch
from grpo_mega.config import AlgorithmConfig
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.reward import compute_rewards
from grpo_mega.rollout.base import Completion


@dataclass
class ScoredGroups:
    """Prompts and their G completions (grouped contiguously) with one reward per completion."""

    records: list[PromptRecord]
    completions: list[Completion]
    rewards: torch.Tensor
    """[num_prompts * G] final rewards (verifier + format + overlong terms)."""
    scores: torch.Tensor
    """[num_prompts * G] the verifier's score alone (``critic/score``)."""

    def __len__(self) -> int:
        return len(self.records)


def score_groups(
    records: Sequence[PromptRecord],
    completions: Sequence[Completion],
    reward_fn,
    *,
    group_size: int,
    algorithm: AlgorithmConfig,
    format_fn=None,
    format_weight: float = 0.0,
) -> ScoredGroups:
    """Reward every completion; adds the weighted format reward and the DAPO overlong penalty when configured."""
    prompts = [r.prompt for r in records for _ in range(group_size)]
    answers = [r.answer for r in records for _ in range(group_size)]
    extras = [r.extra for r in records for _ in range(group_size)]
    texts = [c.text for c in completions]
    scores = compute_rewards(reward_fn, prompts, texts, answers, extras)
    rewards = scores.clone()
    if format_fn is not None and format_weight:
        rewards += format_weight * compute_rewards(format_fn, prompts, texts, answers, extras)
    if algorithm.overlong_buffer:
        lengths = torch.tensor([len(c.response_ids) for c in completions])
        rewards += overlong_penalty(lengths, algorithm.response_length, algorithm.overlong_buffer, algorithm.overlong_penalty)
    return ScoredGroups(list(records), list(completions), rewards, scores)


def keep_informative_groups(groups: ScoredGroups, group_size: int) -> ScoredGroups:
    """Dynamic sampling (DAPO): drop the groups whose rewards are all equal (their advantages are all 0)."""
    grouped = groups.rewards.reshape(-1, group_size)
    keep = (grouped.max(dim=1).values - grouped.min(dim=1).values) > 0
    rows = [g * group_size + i for g in keep.nonzero().flatten().tolist() for i in range(group_size)]
    return ScoredGroups(
        [groups.records[g] for g in keep.nonzero().flatten().tolist()],
        [groups.completions[i] for i in rows],
        groups.rewards[rows],
        groups.scores[rows],
    )


def concat_groups(first: ScoredGroups, second: ScoredGroups) -> ScoredGroups:
    return ScoredGroups(
        first.records + second.records,
        first.completions + second.completions,
        torch.cat([first.rewards, second.rewards]),
        torch.cat([first.scores, second.scores]),
    )


def take_groups(groups: ScoredGroups, count: int, group_size: int) -> ScoredGroups:
    rows = count * group_size
    return ScoredGroups(groups.records[:count], groups.completions[:rows], groups.rewards[:rows], groups.scores[:rows])


def compute_advantages(rewards: torch.Tensor, group_size: int, algorithm: AlgorithmConfig) -> torch.Tensor:
    """Outcome advantages [B] with ROLL-style shaping: reward clip -> group normalisation -> whitening -> clip."""
    if algorithm.reward_clip is not None:
        rewards = clip_rewards(rewards, algorithm.reward_clip)
    advantages = outcome_advantages(rewards, group_size, scale_by_std=algorithm.scale_by_std)
    if algorithm.whiten_advantages:
        advantages = whiten(advantages)
    if algorithm.advantage_clip is not None:
        advantages = clip_advantages(advantages, algorithm.advantage_clip)
    return advantages


def training_batch(groups: ScoredGroups, advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """The engine batch: ``prompt + response`` rows, per-token ``advantages`` and the sampler's log-probs."""
    batch = sequences_to_batch(
        [c.prompt_ids for c in groups.completions], [c.response_ids for c in groups.completions], pad_id
    )
    batch["advantages"] = advantages[:, None] * batch["loss_mask"].float()
    batch["rollout_logprobs"] = response_values_to_tokens(batch, [c.response_logprobs for c in groups.completions])
    return batch

