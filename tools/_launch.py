"""Run a tool's worker on every rank of a TP x PP job: under torchrun / srun, or on local processes.

Under a launcher (RANK and WORLD_SIZE, or SLURM_PROCID, in the environment) the worker runs in this
process, which is one rank of the job. Otherwise `run_job` starts `world_size` local processes
itself, the way torchrun would, so a user needs no launcher on one machine.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_rank(rank: int, fn: Callable, world_size: int, port: int, result_dir: str, args: tuple):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Local ranks share the machine's cores; split them instead of oversubscribing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result = _run_rank(fn, args)
    if rank == 0:
        with open(Path(result_dir) / "rank0.pkl", "wb") as handle:
            pickle.dump(result, handle)


def _run_rank(fn: Callable, args: tuple) -> Any:
    from grpo_mega.parallel import destroy_distributed

    try:
        return fn(*args)
    finally:
        destroy_distributed()


def under_launcher() -> bool:
    """True when torchrun or SLURM started this process as one rank of a job."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def run_job(fn: Callable, world_size: int, *args: Any) -> Any:
    """Run `fn(*args)` on each of `world_size` ranks and return rank 0's result (None elsewhere).

    Under a launcher the job's world size must equal `world_size`. Otherwise local processes are
    spawned; a failing rank raises here with its traceback.
    """
    if under_launcher():
        from grpo_mega.parallel import read_launch_env

        env = read_launch_env()
        if env.world_size != world_size:
            raise ValueError(
                f"the launcher started {env.world_size} processes, but tp*pp={world_size}"
            )
        result = _run_rank(fn, args)
        return result if env.rank == 0 else None
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="grpo_mega_tool_") as result_dir:
        mp.start_processes(
            _local_rank,
            args=(fn, world_size, _free_port(), result_dir, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        with open(Path(result_dir) / "rank0.pkl", "rb") as handle:
            return pickle.load(handle)


def fail(tool: str, error: Exception) -> None:
    """Exit with status 1 and a one-line message: bad input is the user's to fix, not a traceback."""
    sys.exit(f"{tool}: error: {error}")
