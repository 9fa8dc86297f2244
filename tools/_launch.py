"""Run a tool's worker on every rank of a TP x PP job: under torchrun / srun, or on local processes.

Under a launcher (RANK and WORLD_SIZE, or SLURM_PROCID, in the environment) the worker runs in this
process, which is one rank of the job. Otherwise `run_job` runs a one-rank job in this process and starts the
`world_size` local processes of a larger one itself, the way torchrun would, so a user needs no launcher on one
machine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from grpo_mega.run.launcher import run_as_the_only_rank, spawn_local_ranks, under_launcher
from grpo_mega.run.library_warnings import quiet_libraries as quiet_known_warnings

# The tools are entry points: the known-harmless library warnings are filtered here (in this process, before the
# tool imports megatron) and in every rank the tool starts (`_quiet_then_run`).
quiet_known_warnings()


def _quiet_then_run(fn: Callable, *args: Any) -> Any:
    """A local rank's entry: filters are per process, so installed again here for what the worker warns at run time
    (the imports ran in the fork server, under the same filters: grpo_mega.run.rank_preload)."""
    quiet_known_warnings()
    return fn(*args)


def run_job(fn: Callable, world_size: int, *args: Any) -> Any:
    """Run `fn(*args)` on each of `world_size` ranks and return rank 0's result (None elsewhere).

    Under a launcher the job's world size must equal `world_size`. Otherwise one rank runs in this process (it has
    imported what the worker needs) and more are started as local processes; a failing rank raises here with its
    traceback.
    """
    if not under_launcher():
        if world_size == 1:
            return run_as_the_only_rank(fn, args)
        return spawn_local_ranks(_quiet_then_run, world_size, (fn, *args))[0]
    from grpo_mega.parallel import destroy_distributed, read_launch_env

    env = read_launch_env()
    if env.world_size != world_size:
        raise ValueError(f"the launcher started {env.world_size} processes, but tp*pp={world_size}")
    try:
        result = fn(*args)
    finally:
        destroy_distributed()
    return result if env.rank == 0 else None


def fail(tool: str, error: Exception) -> None:
    """Exit with status 1 and a one-line message: bad input is the user's to fix, not a traceback."""
    sys.exit(f"{tool}: error: {error}")
