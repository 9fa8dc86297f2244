"""The arguments the vllm rollout engine gives ``vllm.LLM``, as pure functions (no vLLM import), so that the engine,
the memory planner (``grpo-mega plan``) and the tests read one definition.

Read against vLLM 0.32 (``engine/arg_utils.py``, ``config/vllm.py``): the settings that size vLLM's memory and the
ones colocated training needs are passed explicitly rather than left to vLLM's defaults, which depend on the GPU
vLLM finds at start-up and which the planner could otherwise only guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class BatchLimits:
    """vLLM's scheduler limits: tokens in one forward pass (``max_num_batched_tokens``: prefill chunks + decodes) and
    sequences decoded at once (``max_num_seqs``). They size the start-up profile run (vLLM's activation
    workspace and the sampler's logits) and the CUDA graphs, so the planner needs them."""

    max_num_batched_tokens: int
    max_num_seqs: int


def vllm_default_batch_limits(gpu_bytes: int, gpu_name: str) -> BatchLimits:
    """vLLM 0.32's defaults for offline ``vllm.LLM`` use on a CUDA GPU (``EngineArgs.get_batch_defaults``,
    ``UsageContext.LLM_CLASS``): 16,384 tokens / 1,024 sequences on GPUs of >= 160 GiB, and on GPUs of >= 70 GiB
    other than the A100 (H100, H200); 8,192 / 256 elsewhere (A100 80 GB: larger batches cost it throughput, vllm
    PR #17885). vLLM 0.33 also puts a GB10 (compute capability 12.1) on the small tier; this function, which sees
    no capability, does not (the engine passes the limits explicitly, so engine and plan still agree)."""
    if gpu_bytes >= 160 * GIB or (gpu_bytes >= 70 * GIB and "a100" not in gpu_name.lower()):
        return BatchLimits(max_num_batched_tokens=16384, max_num_seqs=1024)
    return BatchLimits(max_num_batched_tokens=8192, max_num_seqs=256)


def resolve_batch_limits(max_num_batched_tokens: int | None, max_num_seqs: int | None, *, gpu_bytes: int,
                         gpu_name: str) -> BatchLimits:
    """The configured limits (``rollout.max_num_batched_tokens`` / ``rollout.max_num_seqs``), each None taken from
    :func:`vllm_default_batch_limits` for this GPU."""
    defaults = vllm_default_batch_limits(gpu_bytes, gpu_name)
    return BatchLimits(max_num_batched_tokens=max_num_batched_tokens or defaults.max_num_batched_tokens,
                       max_num_seqs=max_num_seqs or defaults.max_num_seqs)


def colocated_arguments(*, joins_job: bool) -> dict[str, Any]:
    """What a vLLM engine built inside the training job (torchrun / srun, torch.distributed initialised) needs.

    - ``distributed_executor_backend="external_launcher"``: vLLM joins the job's process group instead of starting
      worker processes (:mod:`grpo_mega.rollout.vllm_launch` points it at this rank's GPU).
    - ``disable_custom_all_reduce=True``: vLLM's custom all-reduce (``device_communicators/custom_all_reduce.py``)
      allocates its IPC-shared buffers with plain ``cudaMalloc`` outside the pool that sleep mode frees, so they
      stay resident through every update beside the trainer's NCCL buffers (an update that runs short of memory
      has no way to get them back); and its peer-access
      check (``gpu_p2p_access_check``) reads the GPUs this process sees, which under ``srun --gpus-per-task=1``
      are not the replica's. The rollout's all-reduces then go through NCCL (pynccl), as in the colocated modes of
      verl and NeMo-RL, which turn it off too. It matters only for ``rollout.tensor_parallel`` > 1; at 1 there is
      no all-reduce.
    Outside a job (a notebook, ``tensor_parallel_size`` > 1 with vLLM's own workers) vLLM decides both itself.
    """
    if not joins_job:
        return {}
    return {"distributed_executor_backend": "external_launcher", "disable_custom_all_reduce": True}


def routing_replay_arguments(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``vllm.LLM`` needs to return the experts each token was routed to (``rollout.routing_replay``), read
    against vLLM 0.32: ``enable_return_routed_experts`` (``EngineArgs``; ``CompletionOutput.routed_experts``) and
    prefix caching on (the routes of cached prompt blocks are kept with them). ``VllmConfig`` also requires Model
    Runner V2 (the default on a GPU with Triton; vLLM's CPU backend has it only with triton-cpu) and no pipeline
    parallelism. ``llm_kwargs``: the caller's own; ValueError naming the setting that contradicts replay."""
    if llm_kwargs.get("enable_prefix_caching") is False:
        raise ValueError("rollout.routing_replay: vLLM returns routed experts only with prefix caching on "
                         "(enable_prefix_caching=False was passed)")
    if llm_kwargs.get("pipeline_parallel_size", 1) > 1:
        raise ValueError("rollout.routing_replay: vLLM cannot return routed experts with pipeline parallelism "
                         f"(pipeline_parallel_size={llm_kwargs['pipeline_parallel_size']})")
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}
