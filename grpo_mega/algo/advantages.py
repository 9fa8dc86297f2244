"""Group-relative advantages: outcome supervision (GRPO, Dr. GRPO) and process supervision (DeepSeekMath 4.1.3).

Rows of a batch are grouped contiguously: rows ``g*G .. g*G+G-1`` answer the same prompt.
``std`` is the sample (unbiased) standard deviation, as :func:`torch.std` computes it.
"""

from __future__ import annotations

import torch

from grpo_mega.algo._checks import check_finite_rows, check_group_layout, check_std_scaling


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

    normalized = normalize_step_rewards(step_rewards, valid, group_size, scale_by_std=scale_by_std, eps=eps)
    positions = torch.arange(response_mask.shape[1], device=step_ends.device)
    # covers[b, j, t]: token t lies at or before the end of step j, so step j's reward counts towards A_{b,t}.
    covers = (step_ends.unsqueeze(-1) >= positions) & valid.unsqueeze(-1)
    if credit == "sum":
        advantages = torch.einsum("bk,bkt->bt", normalized, covers.to(normalized.dtype))
    else:
        ahead = torch.where(covers, normalized.unsqueeze(-1), torch.full_like(normalized.unsqueeze(-1), float("inf")))
        advantages = ahead.amin(dim=1)
        advantages = torch.where(covers.any(dim=1), advantages, torch.zeros_like(advantages))
    if after_last_step == "capped":
        last_end = torch.where(valid, step_ends.long(), torch.full_like(step_ends.long(), -1)).amax(dim=1)
        has_steps = last_end >= 0
        at_last = advantages.gather(1, last_end.clamp(min=0).unsqueeze(1)).clamp(max=0.0)
        after = (positions.unsqueeze(0) > last_end.unsqueeze(1)) & has_steps.unsqueeze(1)
        advantages = torch.where(after, at_last.expand_as(advantages), advantages)
    return advantages * response_mask.to(advantages.dtype)
