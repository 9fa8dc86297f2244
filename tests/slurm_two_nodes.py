"""A real two-node SLURM cluster on one machine, for tests: two ``slurmd`` in two network namespaces.

Each node is a network namespace (``ip netns``) holding one end of a private veth link (10.77.0.1/24 and
10.77.0.2/24; nothing else is reachable from it) and a UTS namespace whose hostname is the node's name, so torchrun's
rendezvous host test and gloo's address lookup behave as on two machines, and a private mount namespace whose
/etc/hosts (bound from /etc/netns/NAME/hosts) names both nodes; the jobs inherit all three from their slurmd.
slurmctld runs beside the first node's slurmd (same namespace and address); every SLURM client (sbatch, scontrol,
scancel) runs inside that namespace too (:meth:`TwoNodeCluster.command`). The cluster has its own slurm.conf
(``SLURM_CONF``), state folder and munged (its own socket), and its ports live in its own namespaces, so it runs
beside the one-node cluster of slurm_cluster.py, which another pytest worker may start and stop meanwhile.

``two_node_cluster()`` is a generator for a module-scoped pytest fixture; it skips with the reason where the machine
cannot make namespaces (not root, no ``ip``, no CAP_NET_ADMIN) and installs slurm-wlm / munge / iproute2 with apt
when missing (slurm_cluster.py). Everything it starts is stopped at the end, and the namespaces are deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_cluster import _memory_mb, _run, apt_install, stop_daemons

STATE = Path("/tmp/grpo-mega-slurm-2node")
NODES = ("gmnode1", "gmnode2")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
NAMESPACES = ("grpo-mega-n1", "grpo-mega-n2")
VETH = ("gm-veth1", "gm-veth2")
MUNGE_SOCKET = STATE / "munge" / "munge.socket"


@dataclass
class TwoNodeCluster:
    conf: Path
    """This cluster's slurm.conf: ``SLURM_CONF`` of every client command and job."""

    def command(self, *args: str) -> list[str]:
        """``args`` run inside the first node's namespace, where slurmctld listens."""
        return _in_node(0, *args, hostname=False)

    def env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    def run(self, *args: str, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
        return _run(self.command(*args), timeout=timeout, env=env or self.env())


def _check(cmd: list[str], what: str) -> None:
    result = _run(cmd, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"{what} failed ({' '.join(cmd)}): {result.stderr.strip()[-500:]}")


def _can_make_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("a two-node SLURM cluster needs root (network namespaces, slurmd)")
    if shutil.which("ip") is None:
        apt_install(["iproute2"])
    probe = "grpo-mega-probe"
    _run(["ip", "netns", "del", probe], timeout=30)
    result = _run(["ip", "netns", "add", probe], timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot create a network namespace (no CAP_NET_ADMIN?): {result.stderr.strip()[-300:]}")
    _run(["ip", "netns", "del", probe], timeout=30)


def _delete_network() -> None:
    for namespace in NAMESPACES:
        _run(["ip", "netns", "del", namespace], timeout=30)  # also removes its end of the veth pair
        shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
    _run(["ip", "link", "del", VETH[0]], timeout=30)


def _make_network() -> None:
    _delete_network()
    hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(ADDRESSES, NODES))
    _check(["ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1]], "creating the veth pair")
    for namespace, veth, address in zip(NAMESPACES, VETH, ADDRESSES):
        _check(["ip", "netns", "add", namespace], f"creating namespace {namespace}")
        _check(["ip", "link", "set", veth, "netns", namespace], f"moving {veth} to {namespace}")
        inside = ["ip", "netns", "exec", namespace, "ip"]
        _check([*inside, "addr", "add", f"{address}/24", "dev", veth], f"addressing {veth}")
        _check([*inside, "link", "set", veth, "up"], f"bringing {veth} up")
        _check([*inside, "link", "set", "lo", "up"], f"bringing lo up in {namespace}")
        etc = Path("/etc/netns") / namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)


def _write_conf() -> Path:
    conf = STATE / "slurm.conf"
    nodes = "".join(f"NodeName={n} NodeHostname={n} NodeAddr={a} CPUs={os.cpu_count()} RealMemory={_memory_mb()} "
                    f"State=UNKNOWN\n" for n, a in zip(NODES, ADDRESSES))
    conf.write_text(f"""# written by grpo-mega tests/slurm_two_nodes.py
ClusterName=grpotwo
SlurmctldHost={NODES[0]}({ADDRESSES[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# This cluster's own munged; requeued jobs wait for the job credential to expire before they start again (5 s:
# the least Slurm takes, as on tests/slurm_cluster.py's cluster).
AuthInfo=socket={MUNGE_SOCKET},cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
StateSaveLocation={STATE}/ctld
SlurmdSpoolDir={STATE}/spool-%n
SlurmctldPidFile={STATE}/slurmctld.pid
SlurmdPidFile={STATE}/slurmd-%n.pid
SlurmctldLogFile={STATE}/log/slurmctld.log
SlurmdLogFile={STATE}/log/slurmd-%n.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=300
KillWait=30
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=1
{nodes}PartitionName=two Nodes={NODES[0]},{NODES[1]} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _start_munged() -> None:
    folder = MUNGE_SOCKET.parent
    folder.mkdir(parents=True, exist_ok=True)
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    shutil.chown(folder, "munge", "munge")
    folder.chmod(0o755)
    _check(["runuser", "-u", "munge", "--", "munged", "--force", f"--socket={MUNGE_SOCKET}",
            f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed",
            f"--log-file={folder}/munged.log"], "starting munged")


def _in_node(index: int, *command: str, hostname: bool = True) -> list[str]:
    """``command`` run in node ``index``'s network namespace, with that namespace's /etc/hosts and (``hostname``)
    the node's name as its hostname. nsenter + unshare rather than ``ip netns exec``, which remounts /sys and so
    hides /sys/fs/cgroup, without which slurmd does not start."""
    hosts = Path("/etc/netns") / NAMESPACES[index] / "hosts"
    script = f"mount --bind {hosts} /etc/hosts && " + (f"hostname {NODES[index]} && " if hostname else "")
    return ["nsenter", f"--net=/run/netns/{NAMESPACES[index]}", "unshare", "--mount", "--uts", "sh", "-c",
            script + 'exec "$@"', "sh", *command]


def _pids() -> list[Path]:
    return [STATE / "slurmctld.pid", *(STATE / f"slurmd-{n}.pid" for n in NODES), MUNGE_SOCKET.parent / "munged.pid"]


def _stop() -> None:
    """Stop the daemons this cluster's pid files name, and wait (up to 20 s) until they have exited."""
    stop_daemons(_pids())


def _log_tail() -> str:
    logs = [STATE / "log" / "slurmctld.log", *(STATE / "log" / f"slurmd-{n}.log" for n in NODES)]
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1200:]}" for p in logs if p.exists())


def job_processes_on(job_id: str, node: str) -> list[int]:
    """The job's Python processes on ``node``: the launcher (torchrun) of its step and the ranks (the job's
    environment), not the batch shell or srun (on the first node), which stand for SLURM's own handling of a lost node
    (a real node loss takes them too, and SLURM requeues the job: --requeue)."""
    found = []
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            executable = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if executable.startswith("python") and wanted <= environ:
            found.append(int(pid))
    return found


def two_node_cluster():
    """Yield a TwoNodeCluster whose two nodes are idle; skip when this machine cannot run one."""
    _can_make_namespaces()
    if shutil.which("slurmd") is None or shutil.which("slurmctld") is None or shutil.which("munged") is None:
        apt_install(["slurm-wlm", "munge"])
    _stop()  # daemons of an interrupted earlier run
    shutil.rmtree(STATE, ignore_errors=True)
    for sub in ("ctld", "log", *(f"spool-{n}" for n in NODES)):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    conf = _write_conf()
    cluster = TwoNodeCluster(conf=conf)
    env = cluster.env()
    try:
        _make_network()
        _start_munged()
        daemons = [_in_node(0, "slurmctld", "-f", str(conf))]
        daemons += [_in_node(i, "slurmd", "-f", str(conf), "-N", NODES[i]) for i in range(len(NODES))]
        for daemon in daemons:
            result = _run(daemon, timeout=60, env=env)
            if result.returncode != 0:
                pytest.skip(f"{' '.join(daemon)} did not start: {result.stderr[-500:]}\n{_log_tail()}")
        deadline = time.monotonic() + 60
        while True:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                break
            if time.monotonic() > deadline:
                pytest.skip(f"the two SLURM nodes did not become idle in 60 s ({states}; {out.stderr[-300:]}):\n"
                            f"{_log_tail()}")
            time.sleep(0.5)
        yield cluster
    finally:
        _stop()
        _delete_network()
