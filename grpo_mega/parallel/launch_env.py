"""Who am I in the job: rank, world size, local rank and rendezvous address from the launcher.

Three launchers are understood, in this order:
  torchrun (or any launcher that sets RANK and WORLD_SIZE): RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT;
  SLURM `srun` with one task per process: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR
    defaults to the first host of SLURM_JOB_NODELIST and MASTER_PORT to one derived from
    SLURM_JOB_ID, so that every task of a job computes the same address without talking;
  nothing: a single process (rank 0 of 1) that rendezvouses with itself on 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

# Ports derived from a SLURM job id fall in [base, base + span): above the well-known ports and
# below the usual ephemeral range (32768+), so they rarely collide with client sockets.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job as told by its launcher."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes of this node; picks the GPU."""
    master_addr: str
    """Host of rank 0, where the rendezvous store listens."""
    master_port: int
    """Port of the rendezvous store."""
    launcher: str
    """'torchrun', 'slurm' or 'single'."""


def _read_int(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if raw is None:
        raise ValueError(f"environment variable {name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """Return the first host name of a SLURM node list.

    SLURM compresses lists as `prefix[ranges]suffix` items joined by commas, e.g.
    'gpu-[003-010,012],cpu7' -> 'gpu-003' (zero padding kept), 'node7' -> 'node7'.
    """
    match = re.match(r"([^,\[]*)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise ValueError(f"cannot read a host name from SLURM node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size, local rank and rendezvous address from the launcher's environment.

    See the module docstring for the variables read. Raises ValueError naming the variable when
    one is missing or malformed, or when the rank is outside [0, world_size).
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        rank, world_size = _read_int(environ, "RANK"), _read_int(environ, "WORLD_SIZE")
        local_rank = _read_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
        if world_size > 1 and ("MASTER_ADDR" not in environ or "MASTER_PORT" not in environ):
            raise ValueError("RANK/WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not")
        master_addr = environ.get("MASTER_ADDR", "127.0.0.1")
        master_port = (
            _read_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else _free_local_port()
        )
        launcher = "torchrun"
    elif "SLURM_PROCID" in environ:
        rank, world_size = _read_int(environ, "SLURM_PROCID"), _read_int(environ, "SLURM_NTASKS")
        local_rank = _read_int(environ, "SLURM_LOCALID")
        if "MASTER_ADDR" in environ:
            master_addr = environ["MASTER_ADDR"]
        else:
            nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
            if not nodelist:
                raise ValueError(
                    "under SLURM, set MASTER_ADDR or run inside a job (SLURM_JOB_NODELIST)"
                )
            master_addr = first_slurm_host(nodelist)
        if "MASTER_PORT" in environ:
            master_port = _read_int(environ, "MASTER_PORT")
        elif "SLURM_JOB_ID" in environ:
            master_port = _SLURM_PORT_BASE + _read_int(environ, "SLURM_JOB_ID") % _SLURM_PORT_SPAN
        else:
            raise ValueError("under SLURM, set MASTER_PORT or run inside a job (SLURM_JOB_ID)")
        launcher = "slurm"
    else:
        rank, world_size, local_rank = 0, 1, 0
        master_addr, master_port, launcher = "127.0.0.1", _free_local_port(), "single"
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size} (launcher: {launcher})")
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank} is negative (launcher: {launcher})")
    return LaunchEnv(rank, world_size, local_rank, master_addr, master_port, launcher)


def megatron_cuda_environment(tp: int, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables megatron's tensor-parallel layers need that are not set in ``environ``: at TP > 1 their
    backward overlaps the input-gradient all-reduce (or, with sequence parallelism, reduce-scatter) with the
    weight-gradient matmul by launching the collective first, which only overlaps when the GPU runs kernels in
    launch order: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (megatron ``tensor_parallel/layers.py``, which warns without
    it). Read by CUDA when the process creates its context, so it is set before the process touches the GPU. A value
    the user set is kept (megatron's warning then shows)."""
    if tp > 1 and "CUDA_DEVICE_MAX_CONNECTIONS" not in environ:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def nccl_fault_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """NCCL settings, not set in ``environ``, that make a dead or hung peer end the job instead of hanging it:
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: torch's NCCL watchdog aborts the communicators and tears the process down
    when a collective passes the process group's timeout or a peer fails (torch ``distributed/constants.py``: the
    timeout is enforced only with it or ``TORCH_NCCL_BLOCKING_WAIT``). A value the user set is kept. Read when the
    NCCL groups are created; gloo ignores it (its collectives raise on timeout by themselves)."""
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in environ:
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
