"""Start the processes of a distributed job: reuse a launcher's, relaunch under torchrun, or spawn local ranks.

Under torchrun or SLURM (RANK / SLURM_PROCID set) a command runs in this process, which is one rank of the job.
Otherwise ``grpo_mega.run.torchrun.relaunch_with_torchrun`` execs the same command line under torchrun (the
CLI's ``--nproc``), ``run_as_the_only_rank`` runs a function here as a one-process job, and ``spawn_local_ranks``
runs a picklable function on new local processes (on a CPU build of torch forked from a server that has imported
torch, megatron-core and transformers once) with a torchrun-like environment (the conversion tools and the
multi-process tests).
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_mega.run.shared_fork_server import LauncherSide, use_if_offered


def under_launcher() -> bool:
    """True when this process is one rank of a job started by torchrun or srun."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one of ``world_size`` ranks sharing this machine: its cores split evenly."""
    return max(1, (os.cpu_count() or 1) // world_size)


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


PRELOADED = ["grpo_mega.run.rank_preload", "grpo_mega.trainer", "grpo_mega.sft", "prm.train"]
"""Imported once, by the fork server every local rank is forked from (multiprocessing's ``forkserver`` start
method): torch, megatron-core and transformers, so that a rank starts with them loaded instead of importing them
again (5-7 s of CPU per rank on the 2-core test machine, where the suite starts hundreds of ranks), then the training
loops our commands' ranks run (GRPO, SFT, PRM: another 0.5 s per rank, measured 2026-12-06; named here, not imported,
as they sit in the layers above this one; none reads the environment or starts a thread at import). Importing them
runs no device code and starts no thread pool, so forking the server is as clean a start as a fresh interpreter; a
rank still gets the caller's environment, standard output and error, working directory and ``sys.path`` of the
moment it is started (``grpo_mega.run.shared_fork_server.LauncherSide``, and multiprocessing's own preparation)."""


def _start_method() -> str:
    """``forkserver`` with :data:`PRELOADED` on a CPU build of torch; ``spawn`` where torch is built for CUDA (or
    the system has no fork server): a library that initialises CUDA at import (Transformer Engine reads the device
    when it loads) would leave every rank forked after it unable to use the GPU, and no GPU has run this yet."""
    import multiprocessing

    import torch

    if torch.version.cuda is not None or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    fork_from_a_preloaded_server()
    return "forkserver"


def fork_from_a_preloaded_server() -> bool:
    """Have this process's ``forkserver`` ranks forked from a server with :data:`PRELOADED` imported: the shared
    one offered to it (``grpo_mega.run.shared_fork_server``; returns True), else its own, started now if it is not
    running (returns False): it preloads them while this process goes on, and ends with this process
    (``grpo_mega.run.lifeline``)."""
    from grpo_mega.run.lifeline import start_fork_server

    if use_if_offered():
        return True
    start_fork_server(PRELOADED)
    return False


def _torchrun_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a ``world_size``-process job on this machine."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _leave_no_process_group() -> None:
    """Destroy the process groups (and megatron's) this process holds, if any."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from grpo_mega.parallel import destroy_distributed

        destroy_distributed()


def _local_rank(rank: int, fn: Callable, world_size: int, port: int, threads: int | None, result_dir: str,
                args: tuple, launcher: int) -> None:
    """One local rank: the caller's environment and streams (adopted on arrival from the ``LauncherSide`` that
    became ``launcher``, the caller's pid: a forked rank would otherwise have the fork server's, from when it
    started) with torchrun's variables, ``threads`` intra-op threads, run ``fn``, pickle its result."""
    os.environ.update(_torchrun_variables(rank, world_size, port))
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interpreter has it: a Ctrl-C raises here

    # Set explicitly: OpenMP read OMP_NUM_THREADS when the fork server loaded it, not from this environment.
    if threads is None:
        configured = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(configured) if configured.isdigit() and int(configured) > 0 else threads_per_rank(world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    from grpo_mega.run.library_warnings import quiet_libraries

    quiet_libraries()  # a spawned rank (CUDA builds of torch) starts without the fork server's filters
    try:
        result = fn(*args)
    finally:
        _leave_no_process_group()  # even on failure, so the other ranks see a clean exit
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(result, handle)


def run_as_the_only_rank(fn: Callable, args: tuple = ()) -> Any:
    """Run ``fn(*args)`` in this process as rank 0 of a one-process job (torchrun's variables set, a free
    rendezvous port): what ``spawn_local_ranks(fn, 1)`` does, without starting a process, so the modules this process
    has imported serve the job instead of a second interpreter importing them again. The environment, torch's
    intra-op thread count and the process groups are as before when it returns or raises."""
    import torch

    environment, threads = dict(os.environ), torch.get_num_threads()
    os.environ.update(_torchrun_variables(0, 1, free_port()))
    try:
        return fn(*args)
    finally:
        _leave_no_process_group()
        os.environ.clear()
        os.environ.update(environment)
        torch.set_num_threads(threads)


def spawn_local_ranks(
    fn: Callable, world_size: int, args: tuple = (), *, threads: int | None = None, timeout: float | None = None
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new local processes, the way torchrun would; results by rank. On a CPU
    build of torch the processes are forked from a server that has imported :data:`PRELOADED` (else spawned).

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
            _local_rank, args=(fn, world_size, free_port(), threads, result_dir, args, LauncherSide()),
            nprocs=world_size, join=False, start_method=_start_method(),
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
