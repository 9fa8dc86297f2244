"""The colocated vLLM replica of one rank: its weights at the rollout TP, its workspace, its KV cache, and how many
full-length sequences the KV cache holds against what a step asks of the replica.

vLLM takes ``rollout.gpu_memory_utilization`` x the GPU's memory for everything it allocates (weights, the
activation workspace its start-up profile measures, CUDA graphs, KV cache) and gives the KV cache what is left.
It is built before the training engines, so that budget is reserved whatever they allocate later. Between
generations it sleeps at level 2 (weights discarded, KV cache freed): it holds ~0 during the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_mega.plan.activations import Shapes

VLLM_DTYPE_BYTES = 2  # bf16 weights and KV cache (the trainer starts vLLM with dtype bfloat16 on a GPU)
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
VLLM_MAX_NUM_SEQS = 256
"""vLLM's engine defaults (``EngineArgs``: max_num_batched_tokens, max_num_seqs) that size its profile run; the
trainer sets neither."""
VLLM_CUDA_GRAPH_BYTES = 2**29
"""CUDA graphs of the decode batch sizes (the trainer runs vLLM without enforce_eager on a GPU): vLLM logs
0.3-0.6 GiB for 7-8B models; 0.5 GiB."""


@dataclass(frozen=True)
class VllmPlan:
    """Per-rank vLLM figures (bytes) and the KV cache's capacity in full-length sequences."""

    tensor_parallel: int
    replicas: int
    budget: int
    """gpu_memory_utilization x the GPU's memory."""
    weights: int
    workspace: int
    """Activation workspace of the start-up profile + CUDA graphs."""
    kv_cache: int
    kv_bytes_per_token: int
    """KV bytes one token takes on one rank of the replica."""
    sequence_tokens: int
    sequences_held: int
    sequences_asked: int
    """rollout_batch_size x G / replicas (one round of generation)."""


def vllm_workspace_bytes(s: Shapes, tp: int) -> int:
    """The profile run's peak: one batch of max_num_batched_tokens through a layer (QKV and fc1 outputs) plus the
    sampler's fp32 logits of max_num_seqs rows, twice (logits and probabilities), and the CUDA graphs."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = VLLM_MAX_NUM_BATCHED_TOKENS * ((q + 2 * kv) + 2 * s.intermediate) // tp * VLLM_DTYPE_BYTES
    sampler = 2 * VLLM_MAX_NUM_SEQS * s.vocab * 4
    return layer + sampler + VLLM_CUDA_GRAPH_BYTES


def plan_vllm(*, shapes: Shapes, weight_elements: int, tensor_parallel: int, world_size: int, gpu_bytes: int,
              gpu_memory_utilization: float, sequence_tokens: int, rollout_sequences: int) -> VllmPlan:
    """vLLM's share of one rank. ``weight_elements``: this rank's parameter elements at the rollout TP (from the
    model built at that TP); ``rollout_sequences``: rollout_batch_size x G."""
    if world_size % tensor_parallel:
        raise ValueError(f"rollout.tensor_parallel={tensor_parallel} does not divide the {world_size} GPUs")
    replicas = world_size // tensor_parallel
    budget = int(gpu_memory_utilization * gpu_bytes)
    weights = weight_elements * VLLM_DTYPE_BYTES
    workspace = vllm_workspace_bytes(shapes, tensor_parallel)
    kv_cache = budget - weights - workspace
    # vLLM replicates KV heads when the replica has more ranks than KV heads.
    kv_heads = max(1, shapes.kv_heads // tensor_parallel)
    per_token = 2 * shapes.layers * kv_heads * shapes.head_dim * VLLM_DTYPE_BYTES
    held = max(0, kv_cache) // (per_token * sequence_tokens)
    return VllmPlan(tensor_parallel=tensor_parallel, replicas=replicas, budget=budget, weights=weights,
                    workspace=workspace, kv_cache=kv_cache, kv_bytes_per_token=per_token,
                    sequence_tokens=sequence_tokens, sequences_held=int(held),
                    sequences_asked=math.ceil(rollout_sequences / replicas))
