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
from pathlib import Path
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


SHM_FOLDER = Path("/dev/shm")


def _mapped_paths() -> set[str]:
    """Every file some live process of this machine has mapped (``/proc/*/maps``) or open (``/proc/*/fd``)."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fields = (line.split(None, 5) for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
            used.update(field[5].strip() for field in fields if len(field) == 6)
        with contextlib.suppress(OSError):
            used.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    return used


def remove_stale_cpu_shm(rank: int, group_size: int, folder: Path = SHM_FOLDER) -> list[Path]:
    """Remove the shared-memory segment of vLLM's CPU communicator that a killed job left for global ``rank`` of a
    tensor-parallel group of ``group_size`` consecutive ranks; returns what was removed.

    vLLM 0.32's CPU backend (``distributed/device_communicators/cpu_communicator.py``) names a tensor-parallel
    group's segment after the worker's init method and the group only: under ``external_launcher`` the init method
    is ``env://``, so every colocated CPU job of a node uses ``/dev/shm/-tp:0-[0-1]-cpushm_<rank>``, creates it
    exclusively, and unlinks it only on a clean shutdown. After a rank was killed, the next start failed with
    ``create shm in SHMManager failed. errno: 17`` (EEXIST): the job could not resume. A segment no live process
    maps or holds open is a dead job's and is removed; one in use is left alone (its job would collide with this one
    in any case). Not needed on GPUs, whose communicators use no such segment."""
    if not folder.is_dir():
        return []
    first = rank - rank % group_size
    suffix = f"-[{'-'.join(str(r) for r in range(first, first + group_size))}]-cpushm_{rank - first}"
    candidates = [path for path in folder.iterdir() if path.name.endswith(suffix) and path.is_file()]
    if not candidates:
        return []
    used = _mapped_paths()
    stale = [path for path in candidates if str(path) not in used]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return stale
