"""The plan: per rank and per phase of a GRPO step, what is resident on the GPU, and whether it fits.

Phases, as the trainer runs them with vLLM colocated (``grpo_mega.trainer``):

- ``generation``: the policy's static bytes (parameters + gradient buffers + optimizer state; parameters only
  with ``parallel.offload_during_rollout``), the forward-only reference and PRM weights, and vLLM's whole budget
  (weights, workspace, KV cache).
- ``prm_scoring`` (``process_reward.source: prm``): the PRM scores the steps inside the rollout stage, before vLLM
  goes to sleep, so it is the generation phase plus the PRM's forward activations; with ``process_reward.scorer:
  vllm``, plus the vLLM PRM awake (its weights, workspace and KV cache: its whole budget), which sleeps at level 1
  in every other phase and holds nothing on the GPU there (``grpo_mega.plan.vllm.VllmPRMPlan``).
- ``update``: the policy's static bytes, the reference and PRM weights, the activations of the largest
  micro-batch and the log-prob chunk buffers; vLLM asleep at level 2 holds only its CUDA-graph pool.
- ``save`` (a checkpoint, after the step's weight sync): the policy's static bytes (an offloaded optimizer state
  comes back for it), the reference and PRM weights, vLLM awake (weights, KV cache, CUDA graphs) and what the save
  gathers on the GPU (``grpo_mega.plan.static.checkpoint_save_bytes``); its host RAM is reported beside.

Every phase also holds the CUDA context and NCCL's buffers (constants below).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_mega.plan.settings import Hardware, MemorySettings
from grpo_mega.plan.static import StaticBytes
from grpo_mega.plan.vllm import VllmPlan, VllmPRMPlan

CUDA_CONTEXT_BYTES = 2**30
"""CUDA context, cuBLAS / cuDNN workspaces and loaded kernels of one process. Not measured here (no GPU): the
context alone is commonly reported at 0.3-0.8 GiB on recent GPUs with CUDA 12's lazy module loading (what
nvidia-smi shows for a process that has only touched the device); rounded up to 1 GiB. The GPU check
(bench/gpu_check.py) measures it where a GPU is lent."""
NCCL_BYTES = 2**30
"""NCCL's device buffers for the process's communicators (megatron's TP / DP / PP groups, vLLM's TP group): by
NCCL's defaults (NCCL_BUFFSIZE 4 MiB per channel and peer, a few channels) tens to a few hundred MiB per
communicator; 1 GiB for all of them. An estimate, like the context's."""
REQUIRED_HEADROOM = 0.10
"""A plan fits when every phase leaves at least this share of the GPU free (allocator fragmentation, what the
estimates miss)."""


@dataclass
class Phase:
    """One phase of a step on the most loaded rank: named byte items and their total."""

    name: str
    items: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass(frozen=True)
class SaveHost:
    """Host RAM a checkpoint save takes (bytes): on one rank, and on a node (every rank of it at once)."""

    per_rank: int
    per_node: int


@dataclass
class Plan:
    """Everything ``grpo-mega plan`` reports (bytes per rank unless said otherwise)."""

    config: str
    hardware: Hardware
    settings: MemorySettings
    tensor: int
    pipeline: int
    data: int
    dtype: str
    parameters: int
    """The policy's parameter elements held by one TP rank, summed over the pipeline stages."""
    policy: StaticBytes
    """The most loaded stage's static bytes."""
    stages: list[StaticBytes]
    """Static bytes of a rank of each pipeline stage (index = pipeline rank)."""
    micro_batch_tokens: int
    head_tokens: int
    activations: int
    logprob_buffers: int
    reference: int
    prm: int | None
    """PRM weights per rank; None when the PRM's config.json could not be read (unknown)."""
    prm_activations: int
    vllm: VllmPlan | None
    phases: list[Phase]
    notes: list[str] = field(default_factory=list)
    save_host: SaveHost | None = None
    prm_hf_config: dict | None = None
    """The PRM's HF config the plan counted (process_reward.source: prm); the step-time model reads its shape."""
    vllm_prm: VllmPRMPlan | None = None
    """The PRM on vLLM (``process_reward.scorer: vllm``); None for the engine scorer (``prm`` counts that one)."""
    unknown: list[str] = field(default_factory=list)
    """Parts the plan could not count (a PRM without a readable config), each saying what is missing; a plan with
    any is no verdict of FITS unless the user accepts them (``grpo-mega plan --accept-unknown``)."""

    @property
    def gpu_bytes(self) -> int:
        return self.hardware.gpu_bytes

    def headroom(self, phase: Phase) -> float:
        """Share of the GPU left free in ``phase``."""
        return 1.0 - phase.total / self.gpu_bytes

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def problems(self) -> list[str]:
        """Why the plan does not fit (empty when it does), each naming the phase and what to change."""
        out = []
        for phase in self.phases:
            if self.headroom(phase) < REQUIRED_HEADROOM:
                out.append(f"{phase.name}: {phase.total / 2**30:.1f} GiB of {self.gpu_bytes / 2**30:.1f} GiB leaves "
                           f"{self.headroom(phase):.0%} free (< {REQUIRED_HEADROOM:.0%}); {_advice(phase.name)}")
        if self.vllm is not None:
            if self.vllm.kv_cache <= 0:
                out.append(f"generation: vLLM's budget ({self.vllm.budget / 2**30:.1f} GiB) does not cover its weights "
                           f"and workspace: raise rollout.gpu_memory_utilization or rollout.tensor_parallel")
            elif self.vllm.sequences_held < 1:
                out.append("generation: vLLM's KV cache cannot hold one full-length sequence "
                           "(data.prompt_length + algorithm.response_length): raise rollout.gpu_memory_utilization "
                           "or rollout.tensor_parallel")
        if self.vllm_prm is not None and self.vllm_prm.kv_cache <= 0:
            out.append(f"prm_scoring: the vLLM PRM's budget ({self.vllm_prm.budget / 2**30:.1f} GiB) does not cover "
                       "its weights and workspace: raise process_reward.vllm_gpu_memory_utilization or "
                       "process_reward.vllm_tensor_parallel")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems

    def verdict_fits(self, *, accept_unknown: bool = False) -> bool:
        """The verdict: every phase fits and nothing was left uncounted (or the user accepts what was)."""
        return self.fits and (accept_unknown or not self.unknown)


def _advice(phase: str) -> str:
    if phase == "save":
        return ("lower rollout.gpu_memory_utilization (vLLM is awake during the save), set "
                "parallel.distributed_optimizer where DP > 1, or raise parallel.tensor / parallel.pipeline")
    if phase == "update":
        return ("lower parallel.max_tokens_per_micro_batch, raise parallel.tensor / parallel.pipeline, or shard the "
                "optimizer (distributed optimizer)")
    return ("lower rollout.gpu_memory_utilization (vLLM then holds fewer sequences at once), raise parallel.tensor, "
            "or set parallel.offload_during_rollout")
