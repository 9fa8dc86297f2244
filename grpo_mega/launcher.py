"""Start the processes of a distributed job: reuse a launcher's, relaunch under torchrun, or spawn local ranks.

Under torchrun or SLURM (RANK / SLURM_PROCID set) a command runs in this process, which is one rank of the job.
Otherwise ``relaunch_with_torchrun`` execs the same command line under ``torch.distributed.run --standalone``
(the CLI's ``--nproc``), and ``spawn_local_ranks`` runs a picklable function on fresh local processes with a
torchrun-like environment (the conversion tools and the multi-process tests).
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def under_launcher() -> bool:
    """True when this process is one rank of a job started by torchrun or srun."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one of ``world_size`` ranks sharing this machine: its cores split evenly."""
    return max(1, (os.cpu_count() or 1) // world_size)


def relaunch_with_torchrun(nproc: int, module_args: list[str], threads_per_process: int | None = None):
    """Become ``python -m torch.distributed.run --standalone --nproc-per-node nproc -m <module_args>`` (exec: this
    process is replaced, so signals sent to it, e.g. a scheduler's SIGTERM, reach torchrun and through it the
    ranks). Does not return.

    Each process gets ``threads_per_process`` intra-op threads (default: cores / nproc), so ranks sharing a
    machine do not oversubscribe its cores.
    """
    threads = threads_per_process or threads_per_rank(nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        # "--" ends torchrun's own options: its parser would otherwise reject, as ambiguous abbreviations of its
        # flags, our flags such as --n or --nproc anywhere in the command line.
        "-m", "--", *module_args,
    ]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, env)


RENDEZVOUS_PORTS = range(30000, 32768)
"""Where ``free_port`` looks: below Linux's ephemeral range (``ip_local_port_range``, 32768-60999 by default), from
which the OS hands out the local ports of every connection and ``bind(("", 0))``, and above the ports derived from
SLURM job ids (``grpo_mega.parallel.launch_env``: 15000-29999). A port picked there stays free between the check and
the moment the spawned ranks bind it (their imports take seconds), however many connections gloo, vLLM or other
jobs open meanwhile: an ephemeral port could be taken in that window (EADDRINUSE at the rendezvous, seen with two
test workers)."""


def free_port() -> int:
    """A TCP port of ``RENDEZVOUS_PORTS`` that was free a moment ago (chosen at random without touching the seeded
    global RNGs); the OS's choice if none of 64 tries is free."""
    chooser = random.SystemRandom()
    for _ in range(64):
        port = chooser.randrange(RENDEZVOUS_PORTS.start, RENDEZVOUS_PORTS.stop)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_rank(rank: int, fn: Callable, world_size: int, port: int, threads: int | None, result_dir: str,
                args: tuple) -> None:
    """One spawned rank: torchrun-like environment, ``threads`` intra-op threads, run ``fn``, pickle its result."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch

    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(world_size))
    try:
        result = fn(*args)
    finally:
        # Leave no process group behind, even on failure, so the other ranks see a clean exit.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from grpo_mega.parallel import destroy_distributed

            destroy_distributed()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(result, handle)


def spawn_local_ranks(
    fn: Callable, world_size: int, args: tuple = (), *, threads: int | None = None, timeout: float | None = None
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh local processes, the way torchrun would; results by rank.

    ``fn`` must be importable by name and its result picklable. ``threads``: intra-op threads per rank (default:
    ``OMP_NUM_THREADS`` when set, else the cores split evenly). A failing rank raises here as
    ``torch.multiprocessing.ProcessRaisedException`` with its traceback, and the other ranks are terminated; ranks
    still running after ``timeout`` seconds are killed and ``TimeoutError`` is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="grpo_mega_ranks_") as result_dir:
        context = mp.start_processes(
            _local_rank, args=(fn, world_size, free_port(), threads, result_dir, args),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                               grace_period=5.0):
            if deadline is not None and time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)} did not finish on {world_size} ranks within {timeout:.0f} s"
                )
        results = []
        for rank in range(world_size):
            with open(Path(result_dir) / f"rank{rank}.pkl", "rb") as handle:
                results.append(pickle.load(handle))
        return results
