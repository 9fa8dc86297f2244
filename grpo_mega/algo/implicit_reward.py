"""The implicit PRM's math (PRIME, Cui et al. 2025, arXiv 2502.01456): process rewards from a language model trained
on outcome labels alone.

A language model pi_phi (initialised like the policy) and a fixed reference pi_ref define, for each response token,

    r_t = beta * (log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t))

and the model is trained on each batch's verifier labels y in {0, 1} by the cross-entropy of the sigmoid of the
summed token rewards, ``BCE(sigmoid(sum_t r_t), y)`` (PRIME's "CE" loss; verl's ``compute_ce_dpo_loss_rm``): a
completion's total implicit reward is the logit of its predicted correctness, so no step labels are needed. The token
rewards become step scores for process supervision (:func:`implicit_step_scores`): the sum over each step's tokens
(:func:`step_sums`), which keeps a completion's step scores summing to its total implicit reward, or the sigmoid of
the implicit Q-value at each step's end, ``sigmoid(sum_{t <= end_k} r_t)``, the PRM's estimate that the solution is
still right after step k (a score in [0, 1], as a learned PRM's).

Functions of tensors only, as the rest of ``grpo_mega.algo``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_mega.algo.choices import IMPLICIT_STEP_VALUES


def implicit_token_rewards(prm_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor,
                           beta: float) -> torch.Tensor:
    """``r_t = beta * (prm_logprobs - ref_logprobs)`` on response tokens, 0 elsewhere; all [B, T]. ValueError for
    shapes that differ or a ``beta`` that is not positive."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if prm_logprobs.shape != ref_logprobs.shape or prm_logprobs.shape != response_mask.shape:
        raise ValueError(f"prm_logprobs {tuple(prm_logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have one shape [B, T]")
    return beta * (prm_logprobs - ref_logprobs) * response_mask.to(prm_logprobs.dtype)


def implicit_outcome_logits(token_rewards: torch.Tensor) -> torch.Tensor:
    """[B]: each completion's summed token rewards, the logit of its predicted correctness."""
    return token_rewards.sum(dim=1)


def implicit_outcome_loss(token_rewards: torch.Tensor, labels: torch.Tensor, *,
                          num_completions: int | None = None) -> torch.Tensor:
    """PRIME's cross-entropy: ``sum_i BCE(sigmoid(sum_t r_{i,t}), y_i) / num_completions`` (default: the rows here;
    a micro-batch passes the global count so that the micro-batches' losses add up to the batch mean). ``labels``
    [B] in [0, 1] (the verifier's outcome; fractional labels are allowed)."""
    if labels.shape != token_rewards.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be [B] for token_rewards {tuple(token_rewards.shape)}")
    logits = implicit_outcome_logits(token_rewards)
    losses = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    count = token_rewards.shape[0] if num_completions is None else num_completions
    return losses.sum() / max(count, 1)


def outcome_prediction_accuracy(token_rewards: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of completions whose predicted correctness (``sum_t r_t > 0``) matches the label (``y >= 0.5``)."""
    predicted = implicit_outcome_logits(token_rewards) > 0
    return float((predicted == (labels >= 0.5)).float().mean()) if labels.numel() else 0.0


def step_sums(token_rewards: torch.Tensor, step_ends: torch.Tensor) -> torch.Tensor:
    """[B, K] step rewards: step j of completion i gets the sum of ``token_rewards[i, t]`` over its tokens
    ``step_ends[i, j-1] < t <= step_ends[i, j]`` (from the first response position for j = 0; positions are indices
    into ``token_rewards``' columns, as ``process_advantages`` reads ``step_ends``), 0 where ``step_ends == -1``.
    Tokens after the last step end belong to no step."""
    if step_ends.dim() != 2 or step_ends.shape[0] != token_rewards.shape[0]:
        raise ValueError(f"step_ends {tuple(step_ends.shape)} must be [B, K] for token_rewards "
                         f"{tuple(token_rewards.shape)}")
    prefix = torch.cat([token_rewards.new_zeros(token_rewards.shape[0], 1), token_rewards.cumsum(dim=1)], dim=1)
    valid = step_ends >= 0
    ends = step_ends.clamp(min=0)
    at_end = prefix.gather(1, ends + 1)  # sum of tokens 0..end
    before = torch.cat([prefix.new_zeros(prefix.shape[0], 1), at_end[:, :-1]], dim=1)  # the previous step's end
    return torch.where(valid, at_end - before, torch.zeros_like(at_end))


def implicit_step_scores(token_rewards: torch.Tensor, step_ends: torch.Tensor, kind: str) -> torch.Tensor:
    """[B, K] step scores from token rewards (``step_ends`` as in :func:`step_sums`, -1 padding gets 0): ``sum``,
    the step sums; ``probability``, ``sigmoid(q_k)`` with ``q_k`` the sum of the token rewards through step k's end
    (the cumulative step sums)."""
    sums = step_sums(token_rewards, step_ends)
    if kind == "sum":
        return sums
    if kind == "probability":
        return torch.where(step_ends >= 0, torch.sigmoid(sums.cumsum(dim=1)), torch.zeros_like(sums))
    raise ValueError(f"implicit step value must be one of {IMPLICIT_STEP_VALUES}, got {kind!r}")


def groups_within_accuracy(labels: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """PRIME's accuracy filter: [B] bool, True for the completions of prompts whose group accuracy (mean label over
    the group's ``group_size`` completions, consecutive rows) lies in [low, high]: groups all right or all wrong
    teach the implicit PRM little and are left out of its update."""
    if group_size < 1 or labels.numel() % group_size:
        raise ValueError(f"{labels.numel()} labels do not split into groups of {group_size}")
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"accuracy bounds must satisfy 0 <= low <= high <= 1, got [{low}, {high}]")
    accuracy = labels.float().view(-1, group_size).mean(dim=1)
    keep = (accuracy >= low) & (accuracy <= high)
    return keep.repeat_interleave(group_size)
