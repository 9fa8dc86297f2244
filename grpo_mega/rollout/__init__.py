"""Rollout: generation engines (``hf``: transformers generate; ``vllm``: vLLM, on GPU or on its CPU backend) and weight
sync from the trainer to them.

The trainer builds an engine with :func:`build_rollout_engine`, samples with ``engine.generate(prompt_ids,
SamplingConfig(...))`` and pushes new weights with :func:`sync_weights`.

It may import ``parallel``, ``perf`` and ``run`` (failure records, the watchdog of bounded phases); the stages,
the trainers, the PRM's policy and the planner import it.
"""

from grpo_mega.rollout.base import Completion, RolloutEngine, SamplingConfig
from grpo_mega.rollout.factory import build_rollout_engine
from grpo_mega.rollout.weight_sync import SyncStats, iter_buckets, sync_weights

__all__ = [
    "Completion",
    "RolloutEngine",
    "SamplingConfig",
    "SyncStats",
    "build_rollout_engine",
    "iter_buckets",
    "sync_weights",
]
