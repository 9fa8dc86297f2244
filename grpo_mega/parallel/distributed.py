"""Start and stop torch.distributed and megatron-core's model-parallel groups for one process.

`init_distributed(tp, pp, seed=..., device=...)` is the one call a trainer makes before building a
model: it reads the launcher environment, picks the device (`resolve_device`: NCCL on a GPU, or
gloo on the CPU with the CPU compatibility layer for megatron-core), creates the process groups
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
from grpo_mega.parallel.launch_env import megatron_cuda_environment, nccl_fault_environment, read_launch_env
from grpo_mega.parallel.layout import ParallelLayout, layout_for_world
from grpo_mega.parallel.roles import current_split, forget_split

# Megatron-LM offsets the seed by 100 per pipeline stage so that stages holding different layers do
# not draw identical initial weights; we keep its convention so runs are comparable.
_PIPELINE_SEED_STRIDE = 100

DEVICE_CHOICES = ("auto", "cpu", "cuda")

_device: torch.device | None = None


def resolve_device(choice: str, *, cuda_available: bool, device_count: int, local_rank: int) -> torch.device:
    """The device a process computes on, from ``parallel.device`` and what the process sees (a pure function).

    ``auto``: CUDA when available, else the CPU. ``cpu``: the CPU even when CUDA is present (gloo and the
    CPU compatibility layer; bit-for-bit tests pin this). ``cuda``: a GPU, ValueError when there is none.
    On CUDA the GPU is ``cuda:0`` when the process sees exactly one (e.g. ``srun --gpus-per-task=1``,
    where CUDA_VISIBLE_DEVICES holds one id), else ``cuda:<local_rank>``; ValueError when the local rank
    has no GPU of its own.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"parallel.device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and not cuda_available):
        return torch.device("cpu")
    if not cuda_available or device_count < 1:
        raise ValueError(
            "parallel.device='cuda' but this process sees no CUDA device (torch.cuda.is_available() is False); "
            "set parallel.device to 'auto' or 'cpu', or run on a GPU node"
        )
    if device_count == 1:
        return torch.device("cuda", 0)
    if not 0 <= local_rank < device_count:
        raise ValueError(
            f"local rank {local_rank} has no GPU: this process sees {device_count} CUDA devices "
            "(start one process per GPU, or give each process one GPU with CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


def _local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def get_device(choice: str | None = None) -> torch.device:
    """The device this process computes on.

    Without ``choice``: the device ``init_distributed`` bound, or before it the ``auto`` choice. With a
    choice (``auto``, ``cpu``, ``cuda``): what ``resolve_device`` gives for this process (LOCAL_RANK or
    SLURM_LOCALID from the environment).
    """
    if choice is None:
        if _device is not None:
            return _device
        choice = "auto"
    cuda_available = torch.cuda.is_available()
    return resolve_device(
        choice,
        cuda_available=cuda_available,
        device_count=torch.cuda.device_count() if cuda_available else 0,
        local_rank=_local_rank_from_env(),
    )


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
    device: str = "auto",
    backend: str | None = None,
    timeout_s: float = 1800.0,
    ep: int = 1,
) -> ParallelLayout:
    """Initialise torch.distributed and megatron parallel_state for a TP x PP (x DP) layout, with the experts of a
    mixture-of-experts model split over ``ep`` ranks (``parallel.expert``).

    Reads the launcher environment (`grpo_mega.parallel.launch_env`), binds this process to its
    device (``device``: ``auto``, ``cpu`` or ``cuda``, see `resolve_device`), creates the global
    process group (NCCL on a GPU, gloo on the CPU, unless `backend` says otherwise), megatron's
    TP/PP/DP groups, and seeds (`seed_everything`). On the CPU the CPU compatibility layer is applied,
    also when CUDA is present. Returns the layout, with dp = world_size / (tp * pp). Raises
    ValueError for a layout that does not fit the world size, an unknown device or backend, NCCL on
    the CPU, ``cuda`` without a GPU for this process, or a second call without `destroy_distributed`.

    ``timeout_s`` (``trainer.collective_timeout_s``) bounds every collective of every group (the default one and
    megatron's): a rank that waits longer for a peer raises. With NCCL, torch's watchdog then aborts the
    communicators and ends the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless set; see
    :func:`~grpo_mega.parallel.launch_env.nccl_fault_environment`), so a dead peer ends the job.
    """
    global _device
    if dist.is_initialized() or parallel_state.model_parallel_is_initialized():
        raise ValueError("init_distributed was already called; call destroy_distributed first")
    env = read_launch_env()
    layout = layout_for_world(tp, pp, env.world_size, ep=ep)
    os.environ.update(megatron_cuda_environment(tp, os.environ))  # before CUDA creates this process's context
    os.environ.update(nccl_fault_environment(os.environ))  # read when the NCCL process groups are created
    cuda_available = torch.cuda.is_available()
    chosen = resolve_device(
        device,
        cuda_available=cuda_available,
        device_count=torch.cuda.device_count() if cuda_available else 0,
        local_rank=env.local_rank,
    )
    on_gpu = chosen.type == "cuda"
    backend = backend or ("nccl" if on_gpu else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not on_gpu:
        raise ValueError(f"backend='nccl' needs a GPU, and this process computes on the CPU (parallel.device={device!r})")
    if on_gpu:
        torch.cuda.set_device(chosen)
    else:
        apply_cpu_compat()
    _device = chosen
    split = current_split()  # a job split into training and rollout worlds: this process's world, over its store
    rendezvous = ({"store": split.world_store()} if split is not None
                  else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"})
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **rendezvous,
    )
    init_model_parallel(tp, pp, seed=seed, timeout_s=timeout_s, ep=ep)
    return layout


def init_model_parallel(
    tp: int, pp: int, *, seed: int, timeout_s: float = 1800.0, ep: int = 1
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
    layout = layout_for_world(tp, pp, dist.get_world_size(), ep=ep)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # experts whole on each expert-parallel rank (grpo_mega.model.moe_config)
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=timeout_s / 60,  # megatron: timedelta(minutes=...), fractions kept
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
    forget_split()
    _device = None
