"""torchrun's ranks forked from the launcher's preloaded server (grpo_mega/run/forked_ranks.py, CPU builds of torch):
a ``-m`` module runs in each as ``python -u -m`` would run it (arguments, ``__main__``, exit status, ``atexit``,
unbuffered output, a session of its own, its name, its launcher's environment), also when forked from a shared server
(grpo_mega/run/shared_fork_server.py), and the ranks end with a launcher killed by SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_mega.run.forked_ranks import FORK_RANKS_ENV, rank_process_name
from grpo_mega.run.procfs import alive
from grpo_mega.run.shared_fork_server import SHARED_FORK_SERVER_ENV, use_if_offered, without_offer

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="CUDA builds of torch start ranks as processes")

PROBE = '''
import atexit, json, os, sys, time
rank = os.environ["RANK"]
out = os.path.join(sys.argv[2], f"rank{rank}")
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
sys.stdout.write(f"rank {rank} unterminated")  # no newline, no flush: seen only with unbuffered streams
time.sleep(0.5)
with open(out + ".json", "w") as handle:
    json.dump({"argv": sys.argv, "name": __name__, "pid": os.getpid(), "session_leader": os.getsid(0) == os.getpid(),
               "parent": os.getppid(), "marker": os.environ.get("PROBE_MARKER"),
               "comm": open("/proc/self/comm").read().strip(), "log_so_far": open(sys.argv[3]).read()}, handle)
while os.path.exists(os.path.join(sys.argv[2], "hold")):
    time.sleep(0.1)
sys.exit(int(sys.argv[1]) if rank == "1" else 0)
'''


def _start(tmp_path: Path, status: int, log: Path, *, how: str = "forked") -> subprocess.Popen:
    """The probe on 2 ranks: ``forked`` from the launcher's own server, from the suite's ``shared`` one, or started
    as ``interpreters``."""
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = dict(os.environ if how == "shared" else without_offer(), PROBE_MARKER="the command's",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               **{FORK_RANKS_ENV: "0" if how == "interpreters" else "1"})
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "grpo_mega.run.torchrun", "--standalone", "--nproc-per-node=2",
                                 "-m", "--", "probe_module", str(status), str(tmp_path), str(log)],
                                stdout=handle, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)


def _report(tmp_path: Path, rank: int, timeout: float = 120.0) -> dict:
    path = tmp_path / f"rank{rank}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"rank {rank} never reported"
        time.sleep(0.1)
    time.sleep(0.2)  # the dump is written in one go; let it close
    return json.loads(path.read_text())


@pytest.mark.parametrize("how", ["forked", "shared", "interpreters"])
def test_a_forked_rank_runs_its_module_as_python_dash_m_would(tmp_path, how, shared_fork_server):
    log = tmp_path / "job.log"
    job = _start(tmp_path, 3, log, how=how)
    assert job.wait(timeout=180) == 3, log.read_text()[-3000:]  # rank 1's status is the job's
    for rank in (0, 1):
        report = _report(tmp_path, rank)
        assert report["argv"][1:] == ["3", str(tmp_path), str(log)]
        assert report["argv"][0] == str(tmp_path / "probe_module.py") and report["name"] == "__main__"
        assert report["session_leader"]  # as torchrun's start_new_session: Ctrl-C reaches the launcher only
        assert f"rank {rank} unterminated" in report["log_so_far"]  # python -u
        assert (tmp_path / f"rank{rank}.atexit").read_text() == "ran"
        assert report["marker"] == "the command's"  # its launcher's environment, whichever process forked it
        if how != "interpreters":
            assert report["comm"] == rank_process_name(str(rank))
        assert (report["parent"] == shared_fork_server.pid) == (how == "shared")  # else a server of the launcher's own, or it


@pytest.mark.parametrize("how", ["forked", "shared"])
def test_the_ranks_end_with_a_sigkilled_launcher(tmp_path, how):
    """torchrun's ranks outlive a SIGKILLed torchrun and run to the end of their job; ours end with their launcher
    (grpo_mega/run/lifeline.py): killed by the kernel with the launcher's own fork server; where the fork server is
    a shared one, which lives on, by their watch on the launcher's pid. (Ranks started as interpreters end with it
    when they run grpo-mega's CLI: tests/test_no_process_outlives.py.)"""
    (tmp_path / "hold").write_text("")  # the ranks' work would go on until the file is removed
    job = _start(tmp_path, 0, tmp_path / "job.log", how=how)
    pids = [_report(tmp_path, rank)["pid"] for rank in (0, 1)]
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its launcher by 5 s"
        time.sleep(0.1)
    assert not any((tmp_path / f"rank{rank}.atexit").exists() for rank in (0, 1))  # killed, not finished


def test_an_offered_server_is_refused_under_slurm_or_once_it_is_gone(tmp_path, shared_fork_server):
    offer = shared_fork_server.offer
    pid, key, address = offer.split(":", 2)
    for environ in ({SHARED_FORK_SERVER_ENV: offer, "SLURM_JOB_ID": "7"},  # a job step's ranks stay on its node
                    {SHARED_FORK_SERVER_ENV: f"{2 ** 22 + 1}:{key}:{address}"},  # a server no longer running
                    {SHARED_FORK_SERVER_ENV: f"{pid}:{key}:{tmp_path / 'gone'}"},  # its socket removed
                    {SHARED_FORK_SERVER_ENV: "not an offer"}, {}):
        assert use_if_offered(environ) is False, environ
