"""Turn credit for multi-turn (tool) rollouts: per-token advantages from an outcome reward and per-turn rewards.

A multi-turn completion i has assistant turns k = 1..K_i with token spans ``[start_k, end_k)`` in the response
(``grpo_mega.rollout.base.TurnRecord``); the tool turns between them are not the policy's and get advantage 0.
Each turn has a reward ``r_{i,k}`` from any source (a PRM's score of the turn, the task's check of a tool call, the
tool's own reward). Rows are grouped contiguously, ``g*G .. g*G+G-1`` answer the same prompt.

Forms (``TURN_CREDIT_FORMS``); ``A^O_i`` is the outcome advantage (:func:`outcome_advantages`):

- ``sum``: ``A_{i,t} = A^O_i + w * sum_{j >= k(t)} n_{i,j}``, ``n`` the turn rewards normalised over the group's
  pooled turns (DeepSeekMath 4.1.3 suffix sums, :func:`process_advantages`): today's process credit with turns as
  steps, the outcome added as its own normalised term (not to the last step's reward, as
  ``process_reward.outcome_on_last_step`` does) so that both forms carry the same ``A^O``. Unbounded: an extra turn
  with ``n > 0`` adds to every token before it (the known hazard).
- ``bounded``: ``A_{i,t} = A^O_i * (1 + m_{i,k(t)})`` (AgentOPSD's reweighting), with
  ``z = normalize_step_rewards(r)`` (pooled over the group's turns, not per turn index: verl #7244's bias),
  ``u_{i,k} = clip(w * z_{i,k}, -b, b)`` and ``m_{i,k} = u_{i,k} - sum_j L_{i,j} u_{i,j} / sum_j L_{i,j}`` (L the
  turns' policy-token counts): the turn term is centred within its completion, token-weighted, so
  ``sum_t A_{i,t} = A^O_i * L_i`` exactly: the turn term moves credit between a completion's turns and adds none
  (``D_i = sum_t (A_{i,t} - A^O_i) = 0``, :func:`turn_term_credit`), so no extra, void or split turn can raise what
  turn credit pays. ``|m| <= 2b < 1`` keeps the factor in ``[1-2b, 1+2b]``, so ``sign(A_{i,t}) = sign(A^O_i)``:
  the outcome's sign never flips. A reweighting was chosen over an additive term capped at ``|A^O_i| (1 - eps)``
  because its bound needs no per-completion cap and it scales with the outcome's own confidence.

A completion with ``A^O_i = 0`` (a group whose outcomes all agree, or a reward exactly at the group's mean) gets 0
on every token under ``bounded``: with no outcome to anchor a sign, a turn term alone is the unbounded per-turn
credit that the hazards are about (IRC, -14 points), and GRPO gives such a group no gradient either.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from grpo_mega.algo._checks import check_finite_rows, check_group_layout
from grpo_mega.algo.advantages import normalize_step_rewards, outcome_advantages, process_advantages
from grpo_mega.algo.choices import MAX_TURNS_OUTCOMES, TURN_CREDIT_FORMS


def turn_token_index(turn_spans: torch.Tensor, response_length: int) -> torch.Tensor:
    """[B, T] long: the turn each response token belongs to, -1 for tokens in no turn (tool tokens, padding).

    ``turn_spans`` [B, K, 2] long holds ``(start, end)`` of each turn, ``(-1, -1)`` after a completion's last turn;
    spans are non-empty, in order and disjoint, and end within ``response_length``.
    """
    if turn_spans.dim() != 3 or turn_spans.shape[-1] != 2:
        raise ValueError(f"turn_spans must be [B, K, 2] (start, end), got shape {tuple(turn_spans.shape)}")
    starts, ends = turn_spans[..., 0].long(), turn_spans[..., 1].long()
    valid = starts >= 0
    if (valid[:, 1:] & ~valid[:, :-1]).any():
        row = (valid[:, 1:] & ~valid[:, :-1]).nonzero()[0, 0].item()
        raise ValueError(f"turn_spans row {row} has a turn after a (-1, -1) pad: {turn_spans[row].tolist()}")
    bad = valid & ((ends <= starts) | (ends > response_length))
    if bad.any():
        row, turn = bad.nonzero()[0].tolist()
        raise ValueError(f"turn_spans[{row}, {turn}] = {turn_spans[row, turn].tolist()}: need start < end <= "
                         f"{response_length} (the response length)")
    overlap = valid[:, 1:] & (starts[:, 1:] < ends[:, :-1])
    if overlap.any():
        row, turn = overlap.nonzero()[0].tolist()
        raise ValueError(f"turn_spans[{row}, {turn + 1}] starts before turn {turn} ends: {turn_spans[row].tolist()}")
    positions = torch.arange(response_length, device=turn_spans.device)
    inside = (positions >= starts.unsqueeze(-1)) & (positions < ends.unsqueeze(-1)) & valid.unsqueeze(-1)
    index = torch.arange(turn_spans.shape[1], device=turn_spans.device).view(1, -1, 1).expand_as(inside)
    return torch.where(inside.any(dim=1), (index * inside).sum(dim=1), torch.full_like(positions, -1).expand(
        inside.shape[0], -1))


def turn_tensors(turns: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(turn_spans [B, K, 2], answered [B], stopped_at_max_turns [B])`` from each completion's
    ``Completion.turns`` (``TurnRecord``s with ``start``, ``end``, ``ended``): K the most turns of any completion,
    answered where a turn ended with a final answer, stopped where the last turn ended at ``max_turns``."""
    num_turns = max((len(t) for t in turns), default=0)
    spans = torch.full((len(turns), max(num_turns, 1), 2), -1, dtype=torch.long)
    for row, records in enumerate(turns):
        for k, record in enumerate(records):
            spans[row, k] = torch.tensor([record.start, record.end])
    answered = torch.tensor([any(r.ended == "answer" for r in records) for records in turns], dtype=torch.bool)
    stopped = torch.tensor([bool(records) and records[-1].ended == "max_turns" for records in turns],
                           dtype=torch.bool)
    return spans[:, :num_turns], answered, stopped


def adjusted_outcomes(outcome_rewards: torch.Tensor, answered: torch.Tensor | None,
                      stopped_at_max_turns: torch.Tensor | None, *, wrong_reward: float = 0.0,
                      max_turns_outcome: str = "wrong") -> torch.Tensor:
    """The outcome rewards the advantages use: ``min(r_i, wrong_reward)`` for a completion with no final answer (a
    missing answer never pays more than a wrong one); a rollout stopped at ``max_turns`` is scored by
    ``max_turns_outcome``: ``wrong`` as a wrong answer (``min(r_i, wrong_reward)``), ``as_is`` with its reward as it
    is (the checker's verdict on whatever it produced), whether it answered or not. ``wrong_reward`` is the reward
    of a wrong answer (the lowest a checked answer gets)."""
    if max_turns_outcome not in MAX_TURNS_OUTCOMES:
        raise ValueError(f"max_turns_outcome must be one of {MAX_TURNS_OUTCOMES}, got {max_turns_outcome!r}")
    capped = outcome_rewards.clamp(max=wrong_reward)
    rewards = outcome_rewards
    if answered is not None:
        rewards = torch.where(answered.bool(), rewards, capped)
    if stopped_at_max_turns is not None:
        at_max = stopped_at_max_turns.bool()
        rewards = torch.where(at_max, capped if max_turns_outcome == "wrong" else outcome_rewards, rewards)
    return rewards


def turn_advantages(
    outcome_rewards: torch.Tensor,
    turn_rewards: torch.Tensor,
    turn_spans: torch.Tensor,
    response_length: int,
    group_size: int,
    *,
    form: str = "bounded",
    weight: float = 1.0,
    bound: float = 0.25,
    answered: torch.Tensor | None = None,
    stopped_at_max_turns: torch.Tensor | None = None,
    wrong_reward: float = 0.0,
    max_turns_outcome: str = "wrong",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-token advantages [B, T] of multi-turn completions (the module docstring has the forms' formulas).

    Args:
        outcome_rewards: [B] each completion's outcome reward (adjusted by :func:`adjusted_outcomes` first).
        turn_rewards: [B, K] per-turn rewards; entries of padded turns are ignored.
        turn_spans: [B, K, 2] long ``(start, end)`` of each assistant turn's policy tokens, ``(-1, -1)`` padding.
        response_length: T. group_size: G.
        form: ``bounded`` (default) or ``sum``.
        weight: w, the turn term's weight (1.0: a turn one group std above the pooled mean moves its tokens'
            credit by ``b`` under ``bounded``, by one outcome std under ``sum``).
        bound: b of ``bounded``, in (0, 0.5): a turn's factor lies in ``[1-2b, 1+2b]``; 0.25 is AgentOPSD's +-25 %.
        answered / stopped_at_max_turns: [B] bool or None; see :func:`adjusted_outcomes`.
    Returns:
        [B, T] advantages, 0 on every token outside the turns (tool tokens, padding).
    """
    if form not in TURN_CREDIT_FORMS:
        raise ValueError(f"form must be one of {TURN_CREDIT_FORMS}, got {form!r}")
    if not 0.0 < bound < 0.5:
        raise ValueError(f"bound must lie in (0, 0.5) so that the factor 1 + m stays positive, got {bound}")
    if weight < 0:
        raise ValueError(f"weight must be >= 0, got {weight}")
    batch = outcome_rewards.shape[0]
    if turn_rewards.dim() != 2 or turn_rewards.shape[0] != batch or turn_spans.shape[:2] != turn_rewards.shape:
        raise ValueError(f"turn_rewards {tuple(turn_rewards.shape)} must be [B, K] and turn_spans "
                         f"{tuple(turn_spans.shape)} [B, K, 2] with B = {batch}")
    check_group_layout(batch, group_size)
    token_turn = turn_token_index(turn_spans, response_length)
    policy = token_turn >= 0
    valid = turn_spans[..., 0] >= 0
    check_finite_rows(torch.where(valid, turn_rewards, torch.zeros_like(turn_rewards)), "turn_rewards", group_size)
    rewards = adjusted_outcomes(outcome_rewards, answered, stopped_at_max_turns, wrong_reward=wrong_reward,
                                max_turns_outcome=max_turns_outcome)
    outcome = outcome_advantages(rewards, group_size, scale_by_std=scale_by_std, eps=eps)
    if form == "sum":
        step_ends = torch.where(valid, turn_spans[..., 1].long() - 1, torch.full_like(turn_spans[..., 1].long(), -1))
        process = process_advantages(turn_rewards, step_ends, policy.to(turn_rewards.dtype), group_size,
                                     scale_by_std=scale_by_std, eps=eps)
        return (outcome.unsqueeze(1) + weight * process) * policy.to(outcome.dtype)
    z = normalize_step_rewards(turn_rewards, valid, group_size, scale_by_std=scale_by_std, eps=eps)
    u = (weight * z).clamp(-bound, bound) * valid.to(z.dtype)
    lengths = (turn_spans[..., 1] - turn_spans[..., 0]).to(z.dtype) * valid.to(z.dtype)
    centre = (u * lengths).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True).clamp(min=1)
    m = (u - centre) * valid.to(z.dtype)
    m_at = m.gather(1, token_turn.clamp(min=0))
    return outcome.unsqueeze(1) * (1 + m_at) * policy.to(outcome.dtype)


def turn_term_credit(advantages: torch.Tensor, turn_spans: torch.Tensor, outcome: torch.Tensor) -> torch.Tensor:
    """[B] the credit the turn term adds to each completion: ``D_i = sum_{t in turns} (A_{i,t} - A^O_i)``.

    This is the quantity the invariants bound: the outcome's own part ``A^O_i * L_i`` grows with the policy-token
    count L_i under plain GRPO as well (the loss aggregation governs that, not turn credit), so what a turn can earn
    from the turn term is D_i."""
    token_turn = turn_token_index(turn_spans, advantages.shape[1])
    policy = (token_turn >= 0).to(advantages.dtype)
    return ((advantages - outcome.unsqueeze(1)) * policy).sum(dim=1)
