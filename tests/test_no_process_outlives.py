"""No process of a ``--nproc 2`` command outlives it, however it ends (issue 79 item 2): success, a Ctrl-C at each
moment of its start, a SIGKILL of the command itself; and a Ctrl-C prints at most one line (none before a rank
could say anything), never a multiprocessing traceback.

Each end of the command is put at a pause point (``grpo_mega.run.interrupts.pause_point``), not after a sleep:
``launcher`` (torchrun importing torch), ``fork_server.preload`` (its fork server importing torch, megatron-core and
transformers, the launcher meeting itself and asking for the ranks), ``fork.arrive`` (a rank forked, before it reads
its arguments), ``step.1`` (the ranks training). The processes of the job are found by a variable in their
environment (every one of them, exec'd or forked, started with the command's: ``/proc/<pid>/environ``), since ranks
lead sessions of their own and a dead launcher's are reparented to init. Commands run without the test suite's
shared fork server (``without_offer``): the launcher starts its own, as a user's command does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from tiny_task import build_tiny_task, tiny_run_overrides

from grpo_mega.run.forked_ranks import FORK_RANKS_ENV
from grpo_mega.run.interrupts import PAUSE_AT_ENV, PAUSE_DIR_ENV
from grpo_mega.run.procfs import processes_left_after, processes_started_with
from grpo_mega.run.shared_fork_server import without_offer

REPO = Path(__file__).resolve().parents[1]
JOB_ENV = "GRPO_MEGA_TEST_JOB"
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
"""Runs the rest of its command line with SIGINT ignored, as a CI runner's background job starts (the hard case)."""
GONE_WITHIN_S = 5.0
RESUMES = "the same command resumes from"

pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="CUDA builds of torch start ranks as processes")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def job_processes(job: str) -> dict[int, str]:
    """pid -> command line of every running process that started with ``JOB_ENV=job``."""
    return processes_started_with(JOB_ENV, job)


def left_after(job: str, timeout: float = GONE_WITHIN_S) -> dict[int, str]:
    """The job's processes still running ``timeout`` seconds from now (killed then, so no test leaks them)."""
    return processes_left_after(JOB_ENV, job, timeout)


def start(task, tmp_path: Path, job: str, pause: str | None, *extra: str, env: dict | None = None):
    run_dir = tmp_path / f"run-{job}"
    environment = {**without_offer(env), "PYTHONPATH": str(REPO), JOB_ENV: job,
                   PAUSE_DIR_ENV: str(tmp_path / "pauses" / job)}
    if pause:
        environment[PAUSE_AT_ENV] = pause
    command = [sys.executable, "-c", IGNORING_SIGINT, "-m", "grpo_mega.cli", "train", "--nproc", "2",
               "--config", str(REPO / "configs" / "quickstart_grpo.yaml"),
               *tiny_run_overrides(task, run_dir, "trainer.total_steps=1", "trainer.eval_every=0",
                                   "trainer.save_every=0", *extra)]
    return subprocess.Popen(command, env=environment, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_pause(tmp_path: Path, job: str, pause: str, child: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not list((tmp_path / "pauses" / job).glob(f"{pause}.*")):
        if child.poll() is not None:
            pytest.fail(f"ended (exit {child.returncode}) before pause point {pause}: {child.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(child.pid, signal.SIGKILL)
            pytest.fail(f"no process reached pause point {pause} within {timeout:.0f} s")
        time.sleep(0.05)


def own_lines(stderr: str) -> list[str]:
    """stderr without the run's log lines (``... INFO ...``, ``... WARNING ...``)."""
    return [line for line in stderr.strip().splitlines() if " INFO " not in line and " WARNING " not in line]


ENDS = {
    # pause point of the Ctrl-C (None: no Ctrl-C, the run of one step ends) -> (exit status, what its one line
    # holds; None: no line, or the launcher's)
    "launcher": (130, "grpo-mega launcher (torchrun): interrupted before the ranks started; run the same command"),
    "fork_server.preload": (130, None),  # the launcher meets itself, asks for the ranks: none has started
    "fork.arrive": (130, None),  # a rank forked, not yet its own: the launcher says it, or nothing does
    "step.1": (130, f"failed (cause=interrupted) at step 1 (step): Ctrl-C (SIGINT); {RESUMES} the start"),
    None: (0, "grpo-mega train: done, 1/1 steps"),
}


def test_every_end_of_the_start_leaves_no_process_and_one_line_at_most(task, tmp_path):
    """A Ctrl-C to the command's process group (a terminal's) at each pause point of the start, and a run that
    ends by itself: exit status, no process of the job 5 s later, one line at most and no traceback."""
    failures = []
    for pause, (status, line) in ENDS.items():
        job = uuid.uuid4().hex
        child = start(task, tmp_path, job, pause)
        if pause is not None:
            wait_for_pause(tmp_path, job, pause, child)
            os.killpg(child.pid, signal.SIGINT)
        try:
            stdout, stderr = child.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
        left, lines = left_after(job), own_lines(stderr)
        if pause is None:  # the first line says what the start does (before it: 50 s of silence under load)
            said = line in stdout + stderr and "Traceback" not in stderr and stdout.splitlines()[0] == (
                "grpo-mega train: starting on 2 processes: importing torch, then building the policy, the rollout "
                "engine (rollout.engine=hf); a line per step follows")
        else:
            said = (len(lines) == 1 and line in lines[0] if line else
                    not lines or lines == [ENDS["launcher"][1] + " again"])
        if child.returncode != status or left or not said:
            failures.append(f"{'Ctrl-C at ' + pause if pause else 'a run of one step'}: exit {child.returncode}, "
                            f"left {left}, stderr {stderr[-2000:]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("interpreters", [False, True], ids=["forked_ranks", "torchrun_interpreters"])
def test_a_sigkilled_command_leaves_no_process_of_its_job(task, tmp_path, interpreters):
    """SIGKILL to the command (the launcher, after its exec) while its ranks train: every process of the job is
    gone within a few seconds, on the forked path and on torchrun's exec'd one (ranks as interpreters: CUDA builds
    of torch, ``GRPO_MEGA_FORK_RANKS=0``), where torchrun's own ranks would train on to the end."""
    job = uuid.uuid4().hex
    child = start(task, tmp_path, job, "step.1", env={**os.environ, FORK_RANKS_ENV: "0" if interpreters else "1"})
    wait_for_pause(tmp_path, job, "step.1", child)
    before = job_processes(job)  # the launcher, its fork server, the ranks, their reapers, a resource tracker
    assert len(before) >= 5, before
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    left = left_after(job)  # (they would hold its pipes open: read them only once they are gone)
    child.communicate(timeout=60)
    assert not left, f"of {before}"
