"""A one-process command run where a shared fork server is offered (grpo_mega/run/forked_command.py): its work runs in
a process forked from that server, which stops with the command, passes its signals on and hands back its exit
status. Each test holds the work at a pause point of the run's checkpoint save (``checkpoint.publish``, the process
writes ``<name>.<pid>`` there) and then acts on the command or on the work's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_task import build_tiny_task, tiny_run_overrides

from grpo_mega.run.interrupts import PAUSE_AT_ENV, PAUSE_DIR_ENV
from grpo_mega.run.procfs import alive, parent_of
from grpo_mega.run.shared_fork_server import without_offer

REPO = Path(__file__).resolve().parents[1]
PAUSE = "checkpoint.publish"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _start(task, tmp_path: Path, env: dict | None = None, nproc: int = 1) -> subprocess.Popen:
    """``grpo-mega train`` on ``nproc`` processes (one step, its checkpoint saved at the end), paused in that save."""
    command = [sys.executable, "-m", "grpo_mega.cli", "train", f"--nproc={nproc}",
               "--config", str(REPO / "configs/quickstart_grpo.yaml"),
               *tiny_run_overrides(task, tmp_path / "run", "trainer.total_steps=1", "parallel.tensor=1",
                                   "trainer.eval_every=0")]
    environment = {**(os.environ if env is None else env), PAUSE_AT_ENV: PAUSE, PAUSE_DIR_ENV: str(tmp_path / "pauses")}
    return subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _paused_pid(tmp_path: Path, command: subprocess.Popen, timeout: float = 240.0) -> int:
    return _paused_pids(tmp_path, command, 1, timeout)[0]


def _paused_pids(tmp_path: Path, command: subprocess.Popen, count: int, timeout: float = 240.0) -> list[int]:
    """The pids of the ``count`` processes of ``command`` paused at :data:`PAUSE`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        markers = list((tmp_path / "pauses").glob(f"{PAUSE}.*"))
        if len(markers) >= count:
            return [int(marker.suffix[1:]) for marker in markers]
        if command.poll() is not None:
            pytest.fail(f"ended (exit {command.returncode}) before the pause: {command.stderr.read()[-3000:]}")
        time.sleep(0.05)
    command.kill()
    pytest.fail(f"no process reached {PAUSE} within {timeout:.0f} s")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_the_work_runs_forked_from_the_offered_server_and_ends_with_a_killed_command(task, tmp_path,
                                                                                      shared_fork_server):
    if shared_fork_server is None:
        pytest.skip("ranks are not forked with this build of torch")
    command = _start(task, tmp_path)
    work = _paused_pid(tmp_path, command)
    assert work != command.pid and parent_of(work) == shared_fork_server.pid
    assert os.getsid(work) == work  # a session and process group of its own, as a rank has
    command.kill()  # SIGKILL: nothing of the command can pass it on
    command.communicate()
    assert _gone(work, timeout=5.0), "the forked work outlived its command"
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_a_signal_to_the_command_reaches_the_work_and_its_exit_status_comes_back(task, tmp_path, shared_fork_server):
    if shared_fork_server is None:
        pytest.skip("ranks are not forked with this build of torch")
    command = _start(task, tmp_path)
    work = _paused_pid(tmp_path, command)
    assert work != command.pid
    os.kill(command.pid, signal.SIGINT)  # to the command alone (a terminal's Ctrl-C would reach its group)
    _, stderr = command.communicate(timeout=120)
    assert command.returncode == 130, stderr[-3000:]
    assert "failed (cause=interrupted) at step 1 (save): Ctrl-C (SIGINT)" in stderr, stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()  # stopped before publishing: discarded whole


def test_a_command_on_two_processes_runs_torchrun_in_the_work_and_forks_its_ranks_from_the_offered_server(
        task, tmp_path, shared_fork_server):
    if shared_fork_server is None:
        pytest.skip("ranks are not forked with this build of torch")
    command = _start(task, tmp_path, nproc=2)
    ranks = _paused_pids(tmp_path, command, count=2)
    assert b"grpo_mega.run.torchrun" not in Path(f"/proc/{command.pid}/cmdline").read_bytes()  # no exec of torchrun
    # from the offered server, not from one the launcher (the forked work) started of its own and preloaded again
    assert [parent_of(rank) for rank in ranks] == [shared_fork_server.pid] * 2
    os.kill(command.pid, signal.SIGINT)  # to the command alone: through the work (torchrun's agent) to the ranks
    _, stderr = command.communicate(timeout=120)
    assert command.returncode == 130, stderr[-3000:]
    assert "failed (cause=interrupted) at step 1 (save): Ctrl-C (SIGINT)" in stderr, stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_a_work_killed_by_a_signal_kills_its_command_by_the_same_signal(task, tmp_path, shared_fork_server):
    if shared_fork_server is None:
        pytest.skip("ranks are not forked with this build of torch")
    command = _start(task, tmp_path)
    work = _paused_pid(tmp_path, command)
    os.kill(work, signal.SIGKILL)
    _, stderr = command.communicate(timeout=60)
    assert command.returncode == -signal.SIGKILL, stderr[-3000:]


def test_without_the_offer_the_command_does_its_work_itself(task, tmp_path):
    command = _start(task, tmp_path, without_offer())
    assert _paused_pid(tmp_path, command) == command.pid
    os.kill(command.pid, signal.SIGINT)
    command.communicate(timeout=120)
    assert command.returncode == 130
