"""Generation split over the rollout replicas of the job: each replica samples for a share of the prompts on its
own rollout engine (every replica holds the full synced weights), then every rank receives every completion.

A replica is one rank (the hf engine), or the ``tensor_parallel_size`` consecutive ranks of one vLLM engine, which
all generate the same prompts with the same seeds; an engine with an attribute ``replica`` (a
:class:`ReplicaLayout`) says which it is."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.distributed as dist

from grpo_mega.rollout.base import Completion, RolloutEngine, SamplingConfig, derive_seed


@dataclass(frozen=True)
class ReplicaLayout:
    """Which rollout replica this rank belongs to."""

    index: int
    """This rank's replica, in [0, count)."""
    count: int
    """Replicas in the job."""
    leader: bool
    """True on one rank per replica: the one whose completions are gathered."""


def replica_of(engine: RolloutEngine) -> ReplicaLayout:
    """The engine's ``replica`` attribute, else one replica per rank."""
    layout = getattr(engine, "replica", None)
    if layout is not None:
        return layout
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return ReplicaLayout(index=rank, count=world, leader=True)


def generate_across_ranks(
    engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *, call_seed: int,
    tool_kwargs: Sequence[Mapping[str, Any]] | None = None,
) -> list[Completion]:
    """``sampling.n`` completions per prompt, grouped contiguously in prompt order, the same list on every rank.

    Replica r samples prompts r, r + replicas, ... with seed ``derive_seed(call_seed, r)``, so the result depends
    only on ``call_seed`` and the number of replicas. ``tool_kwargs``: per prompt, the per-tool keyword arguments
    of a multi-turn engine (``grpo_mega.rollout.turn_loop.TurnLoopEngine``); only given to such an engine.
    """
    replica = replica_of(engine)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(range(replica.index, len(prompt_ids), replica.count))
    local: list[Completion] = []
    if mine:
        replica_sampling = dataclasses.replace(sampling, seed=derive_seed(call_seed, replica.index))
        extra = {"tool_kwargs": [tool_kwargs[i] for i in mine]} if tool_kwargs is not None else {}
        local = engine.generate([list(prompt_ids[i]) for i in mine], replica_sampling, **extra)
        for completion in local:
            completion.prompt_index = mine[completion.prompt_index]
    if not replica.leader:  # the replica's leader contributes the same completions
        local = []
    gathered: list[list[Completion]] = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
    by_prompt: dict[int, list[Completion]] = {}
    for part in gathered:
        for completion in part:
            by_prompt.setdefault(completion.prompt_index, []).append(completion)
    return [c for index in range(len(prompt_ids)) for c in by_prompt[index]]
