"""File-system decisions made once, on global rank 0, and given to every rank (which checkpoint to resume, is it
complete, the publication of a save): every rank acts on the same answer even when their views of a network file
system lag."""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a process group is up; without torch.distributed imported there is none (so the CLI's checks
    before launch, which resolve model paths through this module, do not import torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def is_rank0() -> bool:
    import torch.distributed as dist

    return not is_distributed() or dist.get_rank() == 0


def rank0_decides(decide: Callable[[], T]) -> T:
    """Run ``decide()`` on global rank 0 only and give its result, or its error, to every rank.

    File-system decisions (which checkpoint, is it complete) are made once, so every rank acts on the same
    answer even when their views of a network file system lag; an error is raised on every rank (a
    ValueError stays a ValueError) instead of leaving the other ranks waiting in a collective.
    """
    if not is_distributed():
        return decide()
    import torch.distributed as dist

    box: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as caught:  # re-raised below, on every rank
            error = caught
            box[0] = ("value_error" if isinstance(caught, ValueError) else "error", f"{caught}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if error is not None:
        raise error
    if status == "value_error":
        raise ValueError(value)
    if status == "error":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value
