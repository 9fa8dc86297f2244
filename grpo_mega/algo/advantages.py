"""Group-relative advantages: outcome supervision (GRPO, Dr. GRPO) and process supervision (DeepSeekMath 4.1.3).

Rows of a batch are grouped contiguously: rows ``g*G .. g*G+G-1`` answer the same prompt.
``std`` is the sample (unbiased) standard deviation, as :func:`torch.std` computes it.
"""

from __future__ import annotations

import torch

from grpo_mega.algo._checks import check_finite_rows, check_group_layout, check_std_scaling
from grpo_mega.algo.choices import STEP_BASELINES


def outcome_advantages(
    rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Outcome-supervised GRPO advantages, one per completion.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; with ``scale_by_std=False`` (Dr. GRPO)
    ``A_i = r_i - mean(r_group)``. The same advantage applies to every response token of completion i.

    A group whose rewards are all equal gets advantages 0 (its std is 0, the numerator is 0).

    Args:
        rewards: [B] float, B a multiple of ``group_size``.
        group_size: G, completions per prompt.
    Returns:
        [B] advantages, same dtype as ``rewards``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    num_groups = check_group_layout(rewards.shape[0], group_size)
    check_finite_rows(rewards, "rewards", group_size)
    check_std_scaling(group_size, scale_by_std)
    grouped = rewards.reshape(num_groups, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def _validate_steps(step_ends: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Check step ends and return the [B, K] mask of real steps (``step_ends >= 0``)."""
    seq_len = response_mask.shape[1]
    valid = step_ends >= 0
    if (step_ends < -1).any():
        row, step = (step_ends < -1).nonzero()[0].tolist()
        raise ValueError(f"step_ends[{row}, {step}] = {step_ends[row, step].item()}; use -1 for 'no such step'")
    # Real steps come first, padding (-1) only after them.
    if (valid[:, 1:] & ~valid[:, :-1]).any():
        row = (valid[:, 1:] & ~valid[:, :-1]).nonzero()[0, 0].item()
        raise ValueError(f"step_ends row {row} has a real step after a -1: {step_ends[row].tolist()}")
    if (step_ends >= seq_len).any():
        row, step = (step_ends >= seq_len).nonzero()[0].tolist()
        raise ValueError(
            f"step_ends[{row}, {step}] = {step_ends[row, step].item()} is beyond the response "
            f"(length {seq_len})"
        )
    in_mask = response_mask.bool().gather(1, step_ends.clamp(min=0))
    if (valid & ~in_mask).any():
        row, step = (valid & ~in_mask).nonzero()[0].tolist()
        raise ValueError(
            f"step_ends[{row}, {step}] = {step_ends[row, step].item()} points at a token outside "
            f"response_mask (row {row} has {int(response_mask[row].sum())} response tokens)"
        )
    ordered = step_ends[:, 1:] > step_ends[:, :-1]
    if (valid[:, 1:] & ~ordered).any():
        row = (valid[:, 1:] & ~ordered).nonzero()[0, 0].item()
        raise ValueError(f"step_ends row {row} is not strictly increasing: {step_ends[row].tolist()}")
    return valid


def normalize_step_rewards(
    step_rewards: torch.Tensor,
    valid: torch.Tensor,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalise step rewards over the pooled steps of each group.

    ``R = {r_i^j : i in group, j <= K_i}``; ``n_i^j = (r_i^j - mean(R)) / (std(R) + eps)``
    (``r_i^j - mean(R)`` with ``scale_by_std=False``). Entries where ``valid`` is False are 0.
    A group with fewer than two pooled steps has std 0 by convention (its single step is its own mean, so n = 0).

    Args:
        step_rewards: [B, K] float. valid: [B, K] bool, which entries are real steps.
    Returns:
        [B, K] normalised step rewards.
    """
    num_groups = step_rewards.shape[0] // group_size
    rewards = torch.where(valid, step_rewards, torch.zeros_like(step_rewards))
    pooled = rewards.reshape(num_groups, -1)
    pooled_valid = valid.reshape(num_groups, -1).to(step_rewards.dtype)
    count = pooled_valid.sum(dim=1, keepdim=True)
    mean = pooled.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = (pooled - mean) * pooled_valid
    if scale_by_std:
        var = (centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        centered = centered / (var.sqrt() + eps)
    return centered.reshape(step_rewards.shape)


def step_credit(step_values: torch.Tensor, covers: torch.Tensor, credit: str) -> torch.Tensor:
    """[B, T] per-token credit from [B, K] per-step values: ``sum`` of the steps at or after each token
    (``covers[b, j, t]``: token t lies at or before step j's end), or their ``min``; 0 where no step covers a
    token."""
    if credit == "sum":
        return torch.einsum("bk,bkt->bt", step_values, covers.to(step_values.dtype))
    ahead = torch.where(covers, step_values.unsqueeze(-1), torch.full_like(step_values.unsqueeze(-1), float("inf")))
    return torch.where(covers.any(dim=1), ahead.amin(dim=1), torch.zeros_like(ahead[:, 0]))


def completion_baseline_advantages(
    step_rewards: torch.Tensor,
    valid: torch.Tensor,
    covers: torch.Tensor,
    group_size: int,
    *,
    credit: str = "sum",
    scale_by_std: bool = True,
    eps: float = 1e-6,
    min_std: float = 0.25,
) -> torch.Tensor:
    """Process advantages with the group's baseline subtracted once per completion (``step_baseline: completion``).

    ``C_i(t)`` is token t's raw credit: the sum (``credit="sum"``) or the minimum (``"min"``) of the raw step
    rewards ``r_i^j`` of the steps at or after t; the completion's return ``C_i`` is its first token's
    (``sum_j r_i^j``, or ``min_j r_i^j``). With ``b`` the mean and ``sigma`` the sample std of the returns of the
    group's completions that have steps:

        A_{i,t} = (C_i(t) - b) / (max(sigma, min_std) + eps)        (``scale_by_std=False``: C_i(t) - b)

    The completion's summed credit ``(C_i - b) / scale`` is outcome GRPO's advantage of its return: it does not
    depend on how many steps the return was cut into, so for step rewards whose sum telescopes (``progress``,
    ``delta``, the tree's value differences) adding a step that changes no value, or splitting a step in two, leaves
    it unchanged, and a step with a reward <= 0 (``clip``) can only lower it (a standardised value never rises when
    its own sample falls). ``min_std`` keeps a group whose returns nearly agree (all answers right, say) from having
    the credit within its completions divided by a near-zero spread: 0.25 is the std of 16 0/1 outcomes with one
    success. Rows without steps get 0.

    Args:
        step_rewards: [B, K]; valid: [B, K] bool; covers: [B, K, T] bool (:func:`process_advantages`).
    Returns:
        [B, T] advantages, 0 on tokens no step covers.
    """
    raw = torch.where(valid, step_rewards, torch.zeros_like(step_rewards))
    credit_at = step_credit(raw, covers, credit)
    has_steps = valid.any(dim=1)
    if credit == "sum":
        returns = raw.sum(dim=1)
    else:
        returns = torch.where(valid, step_rewards, torch.full_like(step_rewards, float("inf"))).amin(dim=1)
    returns = torch.where(has_steps, returns, torch.zeros_like(returns))
    grouped, counted = returns.reshape(-1, group_size), has_steps.reshape(-1, group_size).to(returns.dtype)
    count = counted.sum(dim=1, keepdim=True)
    mean = (grouped * counted).sum(dim=1, keepdim=True) / count.clamp(min=1)
    baseline = mean.expand_as(grouped).reshape(-1, 1)
    advantages = credit_at - baseline
    if scale_by_std:
        var = (((grouped - mean) * counted) ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        scale = var.sqrt().clamp(min=min_std) + eps
        advantages = advantages / scale.expand_as(grouped).reshape(-1, 1)
    return torch.where(covers.any(dim=1), advantages, torch.zeros_like(advantages))


def process_advantages(
    step_rewards: torch.Tensor,
    step_ends: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    credit: str = "sum",
    after_last_step: str = "zero",
    baseline: str = "pooled_steps",
    min_std: float = 0.25,
) -> torch.Tensor:
    """Process-supervised GRPO advantages (DeepSeekMath, section 4.1.3): per-token suffix sums.

    Step j of completion i ends at response token ``index(j) = step_ends[i, j]`` and has PRM reward
    ``r_i^j``. With ``n_i^j`` from :func:`normalize_step_rewards` (pooled over the group),
    ``A_{i,t} = sum_{j : index(j) >= t} n_i^j``. Tokens after the last step end get 0, or with
    ``after_last_step="capped"`` (the answer guard, ``grpo_mega.algo.answer_credit``) ``min(A_{i,last}, 0)``, the
    advantage of the last step's last token capped at 0; tokens outside ``response_mask`` get 0. No discount.
    With ``credit="min"`` (PURE's min-form credit assignment)
    ``A_{i,t} = min_{j : index(j) >= t} n_i^j`` instead: a token is credited with the worst step still ahead of it,
    so adding steps cannot raise it.

    ``baseline`` (``algorithm.step_baseline``) is where the group's baseline is subtracted. ``pooled_steps`` is the
    form above: the pooled mean is subtracted from every step, so a completion's summed credit
    ``sum_j n_i^j = (sum_j r_i^j - K_i mean(R)) / std(R)`` moves with its own step count K_i: where mean(R) < 0
    (``clip``, wrong groups) every extra step adds ``|mean(R)| / std(R)``. ``completion`` subtracts it once per
    completion (:func:`completion_baseline_advantages`).

    Args:
        step_rewards: [B, K] float; entries where ``step_ends == -1`` are ignored.
        step_ends: [B, K] long, index within the response of each step's last token, strictly increasing,
            -1 (trailing) where a completion has fewer than K steps. A completion with no steps gets all zeros.
        response_mask: [B, T], 1 on response tokens.
        group_size: G.
    Returns:
        [B, T] advantages.
    """
    if credit not in ("sum", "min"):
        raise ValueError(f"credit must be 'sum' or 'min', got {credit!r}")
    if baseline not in STEP_BASELINES:
        raise ValueError(f"baseline must be one of {STEP_BASELINES}, got {baseline!r}")
    if after_last_step not in ("zero", "capped"):
        raise ValueError(f"after_last_step must be 'zero' or 'capped', got {after_last_step!r}")
    if step_rewards.shape != step_ends.shape or step_rewards.dim() != 2:
        raise ValueError(
            f"step_rewards {tuple(step_rewards.shape)} and step_ends {tuple(step_ends.shape)} must both be [B, K]"
        )
    if response_mask.dim() != 2 or response_mask.shape[0] != step_rewards.shape[0]:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must be [B, T] with B = {step_rewards.shape[0]}"
        )
    check_group_layout(step_rewards.shape[0], group_size)
    check_std_scaling(group_size, scale_by_std)
    valid = _validate_steps(step_ends.long(), response_mask)
    check_finite_rows(torch.where(valid, step_rewards, torch.zeros_like(step_rewards)), "step_rewards", group_size)

    positions = torch.arange(response_mask.shape[1], device=step_ends.device)
    # covers[b, j, t]: token t lies at or before the end of step j, so step j's reward counts towards A_{b,t}.
    covers = (step_ends.unsqueeze(-1) >= positions) & valid.unsqueeze(-1)
    if baseline == "completion":
        advantages = completion_baseline_advantages(step_rewards, valid, covers, group_size, credit=credit,
                                                    scale_by_std=scale_by_std, eps=eps, min_std=min_std)
    else:
        normalized = normalize_step_rewards(step_rewards, valid, group_size, scale_by_std=scale_by_std, eps=eps)
        advantages = step_credit(normalized, covers, credit)
    if after_last_step == "capped":
        last_end = torch.where(valid, step_ends.long(), torch.full_like(step_ends.long(), -1)).amax(dim=1)
        has_steps = last_end >= 0
        at_last = advantages.gather(1, last_end.clamp(min=0).unsqueeze(1)).clamp(max=0.0)
        after = (positions.unsqueeze(0) > last_end.unsqueeze(1)) & has_steps.unsqueeze(1)
        advantages = torch.where(after, at_last.expand_as(advantages), advantages)
    return advantages * response_mask.to(advantages.dtype)
