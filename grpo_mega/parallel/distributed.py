"""Start and stop torch.distributed and megatron-core's model-parallel groups for one process.

`init_distributed(tp, pp, seed=...)` is the one call a trainer makes before building a model: it
reads the launcher environment, picks NCCL on cuda:LOCAL_RANK when CUDA is present and gloo on the
CPU otherwise, applies the CPU compatibility layer for megatron-core, creates the process groups
and seeds every random number generator the way Megatron-LM does.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from grpo_mega.parallel.cpu_compat import apply_cpu_compat
from grpo_mega.parallel.launch_env import read_launch_env
from grpo_mega.parallel.layout import ParallelLayout, layout_for_world

# Megatron-LM offsets the seed by 100 per pipeline stage so that stages holding different layers do
# not draw identical initial weights; we keep its convention so runs are comparable.
_PIPELINE_SEED_STRIDE = 100

_device: torch.device | None = None


def get_device() -> torch.device:
    """The device this process computes on: cuda:LOCAL_RANK with CUDA, else the CPU.

    Before `init_distributed` it answers from the environment (LOCAL_RANK, SLURM_LOCALID).
    """
    if _device is not None:
        return _device
    if torch.cuda.is_available():
        local_rank = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        return torch.device("cuda", int(local_rank))
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch and megatron's model-parallel RNG tracker for this rank.

    Uses seed + 100 * pipeline_rank (Megatron-LM's convention); within that, megatron's tracker
    gives TP ranks distinct streams for tensor-parallel regions (seed + 2718 + tp_rank) and one
    shared stream elsewhere. Needs the model-parallel groups to exist.
    """
    stage_seed = seed + _PIPELINE_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def init_distributed(
    tp: int,
    pp: int,
    *,
    seed: int,
    backend: str | None = None,
    timeout_minutes: int = 30,
) -> ParallelLayout:
    """Initialise torch.distributed and megatron parallel_state for a TP x PP (x DP) layout.

    Reads the launcher environment (`grpo_mega.parallel.launch_env`), binds this process to its
    device, creates the global process group (NCCL with CUDA, gloo without, unless `backend` says
    otherwise), megatron's TP/PP/DP groups, and seeds (`seed_everything`). Returns the layout, with
    dp = world_size / (tp * pp). Raises ValueError for a layout that does not fit the world size,
    an unknown backend, NCCL without CUDA, or a second call without `destroy_distributed` between.
    """
    global _device
    if dist.is_initialized() or parallel_state.model_parallel_is_initialized():
        raise ValueError("init_distributed was already called; call destroy_distributed first")
    env = read_launch_env()
    layout = layout_for_world(tp, pp, env.world_size)
    has_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if has_cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not has_cuda:
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False")
    if has_cuda:
        _device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(_device)
    else:
        _device = torch.device("cpu")
        apply_cpu_compat()
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(minutes=timeout_minutes),
    )
    init_model_parallel(tp, pp, seed=seed, timeout_minutes=timeout_minutes)
    return layout


def init_model_parallel(
    tp: int, pp: int, *, seed: int, timeout_minutes: int = 30
) -> ParallelLayout:
    """Create megatron's TP/PP/DP groups over the running torch.distributed world, and seed.

    `init_distributed` calls it; call it directly (after `destroy_model_parallel`) to switch layout
    inside one job, e.g. to load a checkpoint at one layout and use it at another. Raises
    ValueError if torch.distributed is not initialised or the layout does not fit the world size.
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call init_distributed first")
    if parallel_state.model_parallel_is_initialized():
        raise ValueError("megatron model parallel is already initialised: destroy_model_parallel")
    layout = layout_for_world(tp, pp, dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=timeout_minutes,
        # Kept even with gloo as the main backend: get_megatron_optimizer asks for gloo DP groups.
        create_gloo_process_groups=True,
    )
    seed_everything(seed)
    return layout


def destroy_model_parallel() -> None:
    """Drop megatron's TP/PP/DP groups, keeping torch.distributed; safe when not initialised."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def destroy_distributed() -> None:
    """Tear down megatron's groups and the global process group; safe to call when not initialised.

    Meant for the end of a process: a later `init_distributed` on the same MASTER_PORT in the same
    process can find the old rendezvous store (gloo then fails to connect); switch layouts with
    `destroy_model_parallel` / `init_model_parallel` instead.
    """
    global _device
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _device = None
