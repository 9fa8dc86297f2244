"""Start the distributed job for a command: reuse the launcher's processes, or spawn them with torchrun.

Under torchrun or SLURM (RANK / SLURM_PROCID set) the command runs in this process. Otherwise, with
``nproc > 1``, the same command line is run again under ``torch.distributed.run --standalone`` on this node.
"""

from __future__ import annotations

import os
import subprocess
import sys


def under_launcher() -> bool:
    """True when this process is one rank of a job started by torchrun or srun."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def relaunch_with_torchrun(nproc: int, module_args: list[str], threads_per_process: int | None = None) -> int:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node nproc -m <module_args>``.

    Returns the exit code. Each process gets ``threads_per_process`` intra-op threads (default: cores / nproc),
    so ranks sharing a machine do not oversubscribe its cores.
    """
    threads = threads_per_process or max(1, (os.cpu_count() or 1) // nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", *module_args,
    ]
    return subprocess.call(command, env=env)
