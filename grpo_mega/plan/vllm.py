"""The colocated vLLM replica of one rank: its weights at the rollout TP, its workspace, its CUDA graphs, its KV
cache, and how many full-length sequences the KV cache holds against what a step asks of the replica.

vLLM takes ``rollout.gpu_memory_utilization`` x the GPU's memory for everything it allocates (weights, the
activation workspace its start-up profile measures, CUDA graphs, KV cache) and gives the KV cache what is left.
It is built before the training engines, so that budget is reserved whatever they allocate later. Between
generations it sleeps at level 2: weights discarded and KV cache freed, but not its CUDA-graph pool, which stays
through the update unless ``rollout.enforce_eager`` (vLLM 0.32 captures the graphs outside its sleep-mode pool
unless ``sleep_mode_offload_cudagraph``, off by default, routes them into it to be copied to the host at each
sleep: ``compilation/cudagraph_pool.py``, ``config/vllm.py`` ``use_cumem_cudagraph_pool``).

The profile run is sized by the scheduler limits the engine passes explicitly
(:func:`grpo_mega.rollout.vllm_settings.resolve_batch_limits`: ``rollout.max_num_seqs`` /
``rollout.max_num_batched_tokens``, else vLLM's defaults for the GPU), so the plan assumes what vLLM runs with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_mega.plan.activations import Shapes
from grpo_mega.rollout.vllm_settings import BatchLimits

VLLM_DTYPE_BYTES = 2  # bf16 weights and KV cache (the trainer starts vLLM with dtype bfloat16 on a GPU)
VLLM_CUDA_GRAPH_BYTES = 2**29
"""CUDA graphs of the decode batch sizes (without ``rollout.enforce_eager``): vLLM logs 0.3-0.6 GiB for 7-8B
models; 0.5 GiB. An estimate, not measured here (no GPU)."""


@dataclass(frozen=True)
class VllmPlan:
    """Per-rank vLLM figures (bytes) and the KV cache's capacity in full-length sequences."""

    tensor_parallel: int
    replicas: int
    budget: int
    """gpu_memory_utilization x the GPU's memory."""
    weights: int
    workspace: int
    """Activation workspace of the start-up profile."""
    cuda_graphs: int
    """CUDA-graph pool (0 with enforce_eager); resident through the update too."""
    limits: BatchLimits
    """max_num_batched_tokens / max_num_seqs the engine passes to vLLM."""
    enforce_eager: bool
    kv_cache: int
    kv_bytes_per_token: int
    """KV bytes one token takes on one rank of the replica."""
    sequence_tokens: int
    sequences_held: int
    sequences_asked: int
    """rollout_batch_size x G / replicas (one round of generation)."""


def vllm_workspace_bytes(s: Shapes, tp: int, limits: BatchLimits, *, sampler: bool = True) -> int:
    """The profile run's peak: one batch of max_num_batched_tokens through a layer (QKV and fc1 outputs) plus, with
    ``sampler`` (a generate runner), the sampler's fp32 logits of max_num_seqs rows, twice (logits and
    probabilities)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = limits.max_num_batched_tokens * ((q + 2 * kv) + 2 * s.intermediate) // tp * VLLM_DTYPE_BYTES
    return layer + (2 * limits.max_num_seqs * s.vocab * 4 if sampler else 0)


def plan_vllm(*, shapes: Shapes, weight_elements: int, tensor_parallel: int, world_size: int, gpu_bytes: int,
              gpu_memory_utilization: float, sequence_tokens: int, rollout_sequences: int, limits: BatchLimits,
              enforce_eager: bool) -> VllmPlan:
    """vLLM's share of one rank. ``weight_elements``: this rank's parameter elements at the rollout TP (from the
    model built at that TP); ``rollout_sequences``: rollout_batch_size x G."""
    if world_size % tensor_parallel:
        raise ValueError(f"rollout.tensor_parallel={tensor_parallel} does not divide the {world_size} GPUs")
    replicas = world_size // tensor_parallel
    budget = int(gpu_memory_utilization * gpu_bytes)
    weights = weight_elements * VLLM_DTYPE_BYTES
    workspace = vllm_workspace_bytes(shapes, tensor_parallel, limits)
    cuda_graphs = 0 if enforce_eager else VLLM_CUDA_GRAPH_BYTES
    kv_cache = budget - weights - workspace - cuda_graphs
    # vLLM replicates KV heads when the replica has more ranks than KV heads.
    kv_heads = max(1, shapes.kv_heads // tensor_parallel)
    per_token = 2 * shapes.layers * kv_heads * shapes.head_dim * VLLM_DTYPE_BYTES
    held = max(0, kv_cache) // (per_token * sequence_tokens)
    return VllmPlan(tensor_parallel=tensor_parallel, replicas=replicas, budget=budget, weights=weights,
                    workspace=workspace, cuda_graphs=cuda_graphs, limits=limits, enforce_eager=enforce_eager,
                    kv_cache=kv_cache, kv_bytes_per_token=per_token,
                    sequence_tokens=sequence_tokens, sequences_held=int(held),
                    sequences_asked=math.ceil(rollout_sequences / replicas))


@dataclass(frozen=True)
class VllmPRMPlan:
    """The vLLM PRM of one rank (``process_reward.scorer: vllm``, ``prm.vllm_scoring``), in bytes. Built with
    ``process_reward.vllm_gpu_memory_utilization`` x the GPU for its weights, workspace and KV cache; on a GPU it
    sleeps at level 1 between scorings (weights to pinned host memory, KV cache freed) and runs without CUDA
    graphs, so outside the ``prm_scoring`` phase it holds nothing on the GPU. vLLM's CPU backend has no sleep
    mode: there it stays resident in every phase."""

    tensor_parallel: int
    replicas: int
    budget: int
    weights: int
    workspace: int
    kv_cache: int
    sleeps: bool
    host_weights: int
    """Pinned host memory its weights take while it sleeps (0 without sleep mode)."""

    @property
    def note(self) -> str:
        """One line for the plan's notes."""
        where = ("asleep at level 1 outside prm_scoring (nothing on the GPU; its weights in "
                 f"{self.host_weights / 2**30:.1f} GiB of pinned host RAM)" if self.sleeps else
                 "resident in every phase (vLLM's CPU backend has no sleep mode)")
        return (f"PRM on vLLM (process_reward.scorer=vllm): {self.replicas} replicas x TP{self.tensor_parallel}, "
                f"{self.budget / 2**30:.1f} GiB per rank (process_reward.vllm_gpu_memory_utilization: weights "
                f"{self.weights / 2**30:.1f}, workspace {self.workspace / 2**30:.1f}, KV cache "
                f"{max(0, self.kv_cache) / 2**30:.1f}); {where}")

    @property
    def resident(self) -> dict[str, int]:
        """What it holds on the device while it scores."""
        return {"vLLM PRM weights": self.weights, "vLLM PRM workspace": self.workspace,
                "vLLM PRM KV cache": max(0, self.kv_cache)}


def plan_vllm_prm(*, shapes: Shapes, weight_elements: int, tensor_parallel: int, world_size: int, gpu_bytes: int,
                  gpu_memory_utilization: float, limits: BatchLimits, sleeps: bool, sampler: bool) -> VllmPRMPlan:
    """The vLLM PRM's share of one rank. ``weight_elements``: this rank's PRM parameter elements at its vLLM TP;
    ``limits``: vLLM's defaults for the GPU (the scorer passes none). ``sampler``: the likelihood layout runs on
    the generate runner (prompt log-probs), whose profile counts the sampler; the pooling runner's output is two
    logits per token."""
    if world_size % tensor_parallel:
        raise ValueError(f"process_reward.vllm_tensor_parallel={tensor_parallel} does not divide the {world_size} "
                         "GPUs that score")
    budget = int(gpu_memory_utilization * gpu_bytes)
    weights = weight_elements * VLLM_DTYPE_BYTES
    workspace = vllm_workspace_bytes(shapes, tensor_parallel, limits, sampler=sampler)
    return VllmPRMPlan(tensor_parallel=tensor_parallel, replicas=world_size // tensor_parallel, budget=budget,
                       weights=weights, workspace=workspace, kv_cache=budget - weights - workspace, sleeps=sleeps,
                       host_weights=weights if sleeps else 0)
