"""Input validation shared by the algo functions: errors that name the offending row or argument."""

from __future__ import annotations

import torch


def check_group_layout(batch_size: int, group_size: int) -> int:
    """Return the number of groups; raise if ``batch_size`` rows cannot be split into groups of ``group_size``."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if batch_size % group_size != 0:
        raise ValueError(
            f"batch of {batch_size} rows is not a whole number of groups of group_size={group_size}; "
            "rows g*G .. g*G+G-1 must answer the same prompt"
        )
    return batch_size // group_size


def check_finite_rows(values: torch.Tensor, name: str, group_size: int) -> None:
    """Raise naming the first row (and its group / member index) that holds a NaN or infinite value."""
    finite = torch.isfinite(values)
    if finite.all():
        return
    bad = (~finite).reshape(values.shape[0], -1).any(dim=1).nonzero()[0, 0].item()
    raise ValueError(
        f"{name}[{bad}] is not finite (value {values[bad].tolist()}); row {bad} is completion "
        f"{bad % group_size} of group {bad // group_size}"
    )


def check_std_scaling(group_size: int, scale_by_std: bool) -> None:
    """Std scaling needs two samples per group: the sample std of one reward is undefined."""
    if scale_by_std and group_size < 2:
        raise ValueError(
            f"scale_by_std=True needs group_size >= 2 (the sample std of a group of {group_size} is undefined); "
            "use more completions per prompt or scale_by_std=False"
        )
