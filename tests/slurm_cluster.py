"""A real one-node SLURM cluster for tests (slurm-wlm + munge from Debian's apt, run as root).

``slurm_cluster()`` is a generator for a session-scoped pytest fixture: it uses a cluster that already answers
``sinfo``, or installs and starts one when the machine allows (root, apt-get, Debian packages), and skips with
the reason otherwise. Daemons it started are stopped at the end; packages it installed are left in place.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpo_mega.run.procfs import alive

STATE = Path("/tmp/grpo-mega-slurm")
SLURM_CONF = Path("/etc/slurm/slurm.conf")
MUNGE_KEY = Path("/etc/munge/munge.key")
CONF_HEADER = "# written by grpo-mega tests/slurm_cluster.py"


@dataclass
class SlurmCluster:
    node: str
    install_seconds: float | None
    """How long installing the packages took (None: they were already installed)."""
    started_daemons: bool


def _run(cmd, timeout=60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _node_idle(node: str) -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        out = _run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and out.stdout.strip() == "idle"


def apt_install(packages: list[str]) -> float:
    """Install Debian ``packages`` with apt-get (root); the seconds it took. Skips the test with the reason when the
    machine cannot. Waits for the dpkg lock, which another pytest worker's install may hold."""
    if os.geteuid() != 0:
        pytest.skip(f"{' '.join(packages)} not installed and installing needs root")
    if shutil.which("apt-get") is None:
        pytest.skip(f"{' '.join(packages)} not installed and there is no apt-get to install them")
    start = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "--no-install-recommends", *packages]
    result = _run(install, timeout=1200, env=env)
    if result.returncode != 0:
        update = _run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update"], timeout=900, env=env)
        result = _run(install, timeout=1200, env=env)
        if result.returncode != 0:
            pytest.skip(f"apt-get install {' '.join(packages)} failed: {(update.stderr + result.stderr)[-800:]}")
    return time.monotonic() - start


def _install() -> float:
    return apt_install(["slurm-wlm", "munge"])


def cpu_node_options() -> list[str]:
    """sbatch options that fit the scripts' GPU-node requests (#SBATCH --gpus-per-node / --cpus-per-task) to a test
    cluster's CPU nodes: command-line options override #SBATCH lines."""
    return ["--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}"]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 1024
    return 1024


def _configure(node: str) -> None:
    for sub in ("ctld", "d", "log"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
    shutil.chown(MUNGE_KEY, "munge", "munge")
    MUNGE_KEY.chmod(0o400)
    SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
    SLURM_CONF.write_text(f"""{CONF_HEADER}
ClusterName=grpotest
SlurmctldHost={node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Requeued jobs wait for the job credential to expire before they start again (default 120 s; 5 s is the least
# Slurm takes: src/common/slurm_cred.c refuses less). Every requeue of the suite waits it out with a worker idle.
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
StateSaveLocation={STATE}/ctld
SlurmdSpoolDir={STATE}/d
SlurmctldPidFile={STATE}/slurmctld.pid
SlurmdPidFile={STATE}/slurmd.pid
SlurmctldLogFile={STATE}/log/slurmctld.log
SlurmdLogFile={STATE}/log/slurmd.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=300
KillWait=30
# A requeued job becomes eligible again cred_expire + 1 s after the requeue, but only a scheduler pass starts it: the
# backfill pass runs every bf_interval (default 30 s) and the main pass every sched_interval (default 60 s), which
# left requeued test jobs pending 0-30 s longer than needed. One node, a handful of jobs: passes every second cost
# nothing.
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=1
NodeName={node} CPUs={os.cpu_count()} RealMemory={_memory_mb()} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")


MUNGE_PID = Path("/run/munge/munged.pid")


def _start_daemons() -> bool:
    """Start munged (unless it runs) and the SLURM daemons; True when this started munged."""
    munge_running = _run(["munge", "-n"], timeout=10).returncode == 0 if shutil.which("munge") else False
    if not munge_running:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        result = _run(["runuser", "-u", "munge", "--", "munged", "--force"], timeout=30)
        if result.returncode != 0:
            pytest.skip(f"munged did not start: {result.stderr[-500:]}")
    for daemon in ("slurmctld", "slurmd"):
        result = _run([daemon], timeout=60)
        if result.returncode != 0:
            pytest.skip(f"{daemon} did not start: {result.stderr[-500:]}")
    return not munge_running


def daemon_pid(pid_file: Path) -> int | None:
    """The pid ``pid_file`` names, where that process is still a SLURM or munge daemon (a pid file left by a machine
    that restarted may name any process now); None otherwise."""
    try:
        pid = int(pid_file.read_text().strip())
        return pid if Path(f"/proc/{pid}/comm").read_text().strip() in {"slurmd", "slurmctld", "munged"} else None
    except (OSError, ValueError):
        return None


def stop_daemons(pid_files: list[Path]) -> None:
    """SIGTERM the daemons the pid files name (:func:`daemon_pid`), one at a time in that order, each once the one
    before has exited (20 s for all): slurmctld goes before the slurmd it may still be sending a message to, which
    it would otherwise wait seconds for at its shutdown ("Dropped 1 hung communications to shutdown")."""
    deadline = time.monotonic() + 20
    for pid_file in pid_files:
        pid = daemon_pid(pid_file)
        if pid is None:
            continue
        try:
            os.kill(pid, 15)
        except OSError:
            continue
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _stop_daemons(munge: bool) -> None:
    stop_daemons([STATE / "slurmctld.pid", STATE / "slurmd.pid"] + ([MUNGE_PID] if munge else []))


def _cancel_every_job() -> None:
    """SIGKILL every job of a running test cluster (a run killed before its teardown left them) and wait, up to 30 s,
    until none is left."""
    if _run(["scancel", "--full", "--signal=KILL", "--state=RUNNING"], timeout=30).returncode != 0:
        return  # no cluster answers
    _run(["scancel", "--state=PENDING"], timeout=30)
    deadline = time.monotonic() + 30
    while _run(["squeue", "-h", "-t", "R,CG"], timeout=30).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)


def slurm_cluster():
    """Yield a SlurmCluster whose node is idle; skip when this machine cannot run one."""
    node = socket.gethostname().split(".")[0]
    ours = SLURM_CONF.exists() and SLURM_CONF.read_text().startswith(CONF_HEADER)
    if not ours and shutil.which("sinfo") and _run(["sinfo", "-h"], timeout=10).returncode == 0:
        # A cluster answers already (a real one: the tests' own, left by a run killed before its teardown, is
        # restarted empty below).
        out = _run(["sinfo", "-h", "-o", "%n"], timeout=10).stdout.split()
        if out:
            node = out[0]
        yield SlurmCluster(node=node, install_seconds=None, started_daemons=False)
        return
    install_seconds = None
    if shutil.which("sbatch") is None or shutil.which("slurmctld") is None:
        install_seconds = _install()
    if os.geteuid() != 0:
        pytest.skip("starting the SLURM daemons needs root")
    # A run stopped hard (the machine or session ended mid-test) leaves its daemons' state behind: a job it recovers
    # as RUNNING holds the node ("alloc") with no process behind it and every new job pends for good. This cluster
    # is the tests' own, so it starts empty.
    # Only where our slurmctld runs: against none, scancel retries its connection for ~18 s before it gives up.
    if ours and shutil.which("scancel") and daemon_pid(STATE / "slurmctld.pid") is not None:
        _cancel_every_job()
    _stop_daemons(munge=False)
    shutil.rmtree(STATE, ignore_errors=True)
    _configure(node)
    started_munge = False
    try:
        started_munge = _start_daemons()
        deadline = time.monotonic() + 60
        while not _node_idle(node):
            if time.monotonic() > deadline:
                log = (STATE / "log" / "slurmctld.log")
                tail = log.read_text()[-1500:] if log.exists() else ""
                pytest.skip(f"SLURM node {node} did not become idle in 60 s: {tail}")
            time.sleep(0.5)
        yield SlurmCluster(node=node, install_seconds=install_seconds, started_daemons=True)
    finally:
        _stop_daemons(started_munge)
