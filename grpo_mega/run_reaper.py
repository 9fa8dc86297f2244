"""No process outlives its rank: helpers a rank started (megatron's checkpoint writers and their multiprocessing
manager, vLLM's engine processes, resource trackers) are killed when the rank ends, however it ends.

torchrun starts every rank in a session and process group of its own and, on teardown, signals the groups of the
ranks that are still alive only (``torch.distributed.elastic.multiprocessing.api``: ``if handler.proc.poll() is
None``). The group of a rank that died (SIGKILL, the OOM killer, the phase watchdog's ``os._exit``) is never
signalled, so its helpers live on: measured, a rank SIGKILLed during a save left a forked checkpoint writer, the
writers' manager and a resource tracker running, which held the job step's stdout open, so ``srun`` (and the
SLURM job) never ended; without SLURM they leak their memory on the node.

:func:`reap_group_when_rank_exits` starts one small watcher process per rank (no torch import) that waits for the
rank to exit and then kills the rank's process group. It acts only where the rank leads its own group (as under
torchrun), never on a group a shell or a test shares.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WATCHER = """
import os, signal, sys, time
rank = int(sys.argv[1])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN)   # torchrun signals the whole group while the rank lives: outlast it
while os.getppid() == rank:
    time.sleep(0.5)
os.killpg(rank, signal.SIGKILL)          # the rank has exited: its helpers, and this watcher, go with it
"""


def leads_own_group(pid: int | None = None) -> bool:
    pid = os.getpid() if pid is None else pid
    return os.getpgid(pid) == pid


def reap_group_when_rank_exits(environ=os.environ) -> subprocess.Popen | None:
    """Start the watcher for this process when it is a torchrun rank leading its own process group; returns the
    watcher (None where it does not apply)."""
    if os.name != "posix" or "TORCHELASTIC_RUN_ID" not in environ or not leads_own_group():
        return None
    return subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(os.getpid())], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
