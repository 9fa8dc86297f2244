"""How a vLLM engine joins a running job (``distributed_executor_backend="external_launcher"``): which rank and
which GPU it takes.

What vLLM 0.32 does (``v1/executor/uniproc_executor.py`` ``ExecutorWithExternalLauncher._distributed_args`` and
``v1/worker/gpu_worker.py`` ``Worker.init_device``): it reads ``RANK`` and ``LOCAL_RANK`` from the environment
(nothing else: the process group already exists, so ``MASTER_ADDR`` / ``MASTER_PORT`` are not read), asserts
``LOCAL_RANK < torch.accelerator.device_count()``, and computes on ``cuda:LOCAL_RANK`` (its logical-to-visible
mapping is the identity when nothing else is configured). Its world group's device is ``cuda:LOCAL_RANK`` too.

That is right under torchrun with every GPU of the node visible. Under ``srun --gpus-per-task=1`` each process
sees one GPU (``cuda:0``; the trainer's :func:`grpo_mega.parallel.resolve_device` picks it), while LOCAL_RANK (or
SLURM_LOCALID) is the task's index on the node: vLLM fails its assertion on every task but the first, or, with
several GPUs visible but the trainer bound elsewhere, would put its weights and KV cache on another rank's GPU.
So the engine is built with ``LOCAL_RANK`` set to the index of the GPU this process trains on
(:func:`external_launcher_local_rank`) and ``RANK`` to its torch.distributed rank, both restored afterwards.

vLLM's custom all-reduce is off in this mode (:func:`grpo_mega.rollout.vllm_settings.colocated_arguments` says why).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


def external_launcher_local_rank(device: torch.device, *, visible_devices: int, launcher_local_rank: int | None) -> str:
    """The ``LOCAL_RANK`` vLLM's external_launcher must read so that it computes on ``device``, the device this
    process trains on (a pure function of what the process sees).

    CUDA: the device's index, which vLLM then uses as ``cuda:<index>``; ValueError, naming the fix, when the index
    is not one of the ``visible_devices``. CPU: the launcher's local rank (vLLM's CPU worker binds threads by it),
    or 0 without one.
    """
    if device.type != "cuda":
        return str(launcher_local_rank if launcher_local_rank is not None else 0)
    index = 0 if device.index is None else device.index
    if not 0 <= index < visible_devices:
        raise ValueError(
            f"vllm rollout engine: this process trains on cuda:{index} but sees {visible_devices} CUDA device(s); "
            "vLLM's external_launcher would put the engine on another GPU. Give every process the GPU it trains on: "
            "one GPU per task (srun --gpus-per-task=1) or all GPUs of the node with one process per GPU (torchrun)"
        )
    return str(index)


@contextlib.contextmanager
def external_launcher_environment(rank: int, local_rank: str) -> Iterator[None]:
    """``RANK`` and ``LOCAL_RANK`` as vLLM's external_launcher reads them, while an engine is being built."""
    saved = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK")}
    os.environ["RANK"], os.environ["LOCAL_RANK"] = str(rank), local_rank
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

