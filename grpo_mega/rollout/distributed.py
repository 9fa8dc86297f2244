"""Generation split over all ranks of the job: each rank samples for a share of the prompts on its own rollout
engine (every rank holds the full synced weights), then every rank receives every completion."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch.distributed as dist

from grpo_mega.rollout.base import Completion, RolloutEngine, SamplingConfig, derive_seed


def generate_across_ranks(
    engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *, call_seed: int
) -> list[Completion]:
    """``sampling.n`` completions per prompt, grouped contiguously in prompt order, the same list on every rank.

    Rank r samples prompts r, r + world, ... with seed ``derive_seed(call_seed, r)``, so the result depends only on
    ``call_seed`` and the number of ranks.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(range(rank, len(prompt_ids), world))
    local: list[Completion] = []
    if mine:
        rank_sampling = dataclasses.replace(sampling, seed=derive_seed(call_seed, rank))
        local = engine.generate([list(prompt_ids[i]) for i in mine], rank_sampling)
        for completion in local:
            completion.prompt_index = mine[completion.prompt_index]
    gathered: list[list[Completion]] = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    by_prompt: dict[int, list[Completion]] = {}
    for part in gathered:
        for completion in part:
            by_prompt.setdefault(completion.prompt_index, []).append(completion)
    return [c for index in range(len(prompt_ids)) for c in by_prompt[index]]
