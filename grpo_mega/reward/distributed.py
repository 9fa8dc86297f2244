"""Rank-consistent scoring: every completion is scored once, on one rank, and every rank gets every result.

When each rank scored every completion itself, a verifier that timed out or raised on one rank and not another
made the ranks build different batches (a hang in the next collective, or silent divergence). Here rank r scores
samples r, r + world, ... and the results are gathered, so all ranks hold the same rewards by construction, and a
failure (``on_error="raise"``) stops every rank with the same error instead of leaving the others waiting.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from grpo_mega.reward.compute import RewardError, score_samples
from grpo_mega.reward.types import RewardFunction, SampleReward


def score_across_ranks(
    fn: RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    extras: Sequence[Mapping[str, Any]] | None = None,
    *,
    on_error: str = "zero",
) -> list[SampleReward]:
    """One :class:`SampleReward` per sample, identical on every rank (collective when distributed)."""
    import torch.distributed as dist  # here: the package imports no torch (the CLI checks a reward before launch)

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(range(rank, len(completions), world))
    try:
        local: list[SampleReward] | str = score_samples(
            fn, [prompts[i] for i in mine], [completions[i] for i in mine], [answers[i] for i in mine],
            [extras[i] for i in mine] if extras is not None else None, on_error=on_error, indices=mine,
        )
    except RewardError as error:  # on_error="raise": carried to every rank, raised after the gather
        local = str(error)
    gathered: list[Any] = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    errors = [part for part in gathered if isinstance(part, str)]
    if errors:
        raise RewardError(errors[0])
    results: list[SampleReward | None] = [None] * len(completions)
    for source_rank, part in enumerate(gathered):
        for index, result in zip(range(source_rank, len(completions), world), part):
            results[index] = result
    return results
