"""Issue 79, item 9: a stop signal during a long step. The first SIGTERM asks for a save at the end of the step in
flight (exit 3, tests/test_trainer_preemption.py); a second one, or ``trainer.stop_grace_s`` passing first, ends the
run at once from its last checkpoint, in one line, with exit status 143 (128 + SIGTERM).

Step 2 is made slow on purpose: the test hook ``GRPO_MEGA_PAUSE_AT=step.2`` holds the rank at the start of step 2
(up to 120 s) after step 1's checkpoint was saved. The command is the one a user types, on one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_task import SMALL_RUN, build_tiny_task

from grpo_mega.run.control import SECOND_SIGNAL_AFTER_S
from grpo_mega.run.interrupts import PAUSE_AT_ENV, PAUSE_DIR_ENV

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
ONE_PROCESS = [item for item in SMALL_RUN if not item.startswith("parallel.tensor")]
EXIT_SIGTERM = 128 + signal.SIGTERM


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _command(task, run_dir: Path, *extra: str) -> list[str]:
    model_dir, train_file = task
    return [sys.executable, "-m", "grpo_mega.cli", "train", "--config", GRPO, f"model.hf_config={model_dir}",
            f"data.train_file={train_file}", f"trainer.run_dir={run_dir}", "trainer.save_every=1", *ONE_PROCESS,
            *extra]


def _start_paused_in_step_2(task, tmp_path: Path, *extra: str, markers: int = 1) -> tuple[subprocess.Popen, Path]:
    run_dir, pauses = tmp_path / "run", tmp_path / "pauses"
    env = {**os.environ, "PYTHONPATH": str(REPO), PAUSE_AT_ENV: "step.2", PAUSE_DIR_ENV: str(pauses)}
    job = subprocess.Popen(_command(task, run_dir, "trainer.total_steps=3", *extra), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 300
    while len(list(pauses.glob("step.2.*"))) < markers:  # every rank is in step 2
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.1)
    return job, run_dir


def _stop_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "stopped at once" in line]


def test_a_second_sigterm_ends_a_long_step_at_once_from_the_last_checkpoint(task, tmp_path):
    job, run_dir = _start_paused_in_step_2(task, tmp_path)
    job.send_signal(signal.SIGTERM)  # the first: save at the end of step 2, which is not coming soon
    time.sleep(SECOND_SIGNAL_AFTER_S + 1.0)
    assert job.poll() is None  # the first signal alone waits for the step
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    seconds = time.monotonic() - sent
    checkpoint = run_dir / "checkpoints" / "step_000001"
    assert job.returncode == EXIT_SIGTERM, stderr[-3000:]
    assert _stop_lines(stderr) == [
        f"grpo-mega train: a second stop signal (SIGTERM): stopped at once without saving step 2; the same command "
        f"resumes from its last checkpoint, {checkpoint} (step 1)"], stderr[-3000:]
    assert "Traceback" not in stderr and "stopped after step" not in stderr
    assert seconds < 10, seconds
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert not (run_dir / "checkpoints" / "step_000002").exists()
    # the same command resumes from step 1 and finishes
    resumed = subprocess.run(_command(task, run_dir, "trainer.total_steps=2"), capture_output=True, text=True,
                             timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} at step 1" in resumed.stderr


def test_a_step_that_outlasts_stop_grace_s_ends_at_once(task, tmp_path):
    job, run_dir = _start_paused_in_step_2(task, tmp_path, "trainer.stop_grace_s=3")
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)  # one signal only
    _, stderr = job.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert job.returncode == EXIT_SIGTERM, stderr[-3000:]
    assert _stop_lines(stderr) == [
        f"grpo-mega train: the step in flight did not end within trainer.stop_grace_s=3 s of SIGTERM: stopped at "
        f"once without saving step 2; the same command resumes from its last checkpoint, "
        f"{run_dir / 'checkpoints' / 'step_000001'} (step 1)"], stderr[-3000:]
    assert 3 <= seconds < 15, seconds
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_stop_grace_s_must_not_be_negative(task, tmp_path):
    result = subprocess.run(_command(task, tmp_path / "run", "trainer.stop_grace_s=-1"), capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert result.returncode == 2 and "trainer.stop_grace_s must be >= 0" in result.stderr, result.stderr[-3000:]


def test_a_repeat_within_the_window_is_the_same_signal_and_the_rollout_workers_never_stop_at_once(monkeypatch):
    from grpo_mega.run import control

    calls = []
    clock = [100.0]
    monkeypatch.setattr(control.time, "monotonic", lambda: clock[0])
    requests = control.StopRequests(stop_now=lambda reason, signum: calls.append((reason, signum)))
    requests._on_signal(signal.SIGTERM, None)
    clock[0] += SECOND_SIGNAL_AFTER_S / 2
    requests._on_signal(signal.SIGTERM, None)  # forwarded by a parent: the same stop
    assert calls == [] and requests.signal_name == "SIGTERM"
    clock[0] += SECOND_SIGNAL_AFTER_S
    requests._on_signal(signal.SIGUSR1, None)
    assert calls == [("a second stop signal (SIGUSR1)", signal.SIGUSR1)]
    assert control.exit_status_stopped_now(signal.SIGUSR1) == 128 + signal.SIGUSR1
    worker = control.StopRequests()  # the rollout worker's: its trainer decides
    for _ in range(2):
        worker._on_signal(signal.SIGTERM, None)
        clock[0] += 10 * SECOND_SIGNAL_AFTER_S
    assert worker.signal_name == "SIGTERM"


@pytest.mark.slow
def test_a_second_sigterm_reaches_the_ranks_of_a_two_process_job(task, tmp_path):
    """``--nproc 2``: torchrun's agent forwards the first SIGTERM and waits for the ranks; the second cuts that wait
    short and its agent shuts the ranks down again with SIGTERM (torch's ``SimpleElasticAgent.run``): each rank ends
    at once and says so."""
    job, run_dir = _start_paused_in_step_2(task, tmp_path, "--nproc", "2", markers=2)
    job.send_signal(signal.SIGTERM)
    time.sleep(SECOND_SIGNAL_AFTER_S + 1.0)
    assert job.poll() is None
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert job.returncode == EXIT_SIGTERM, stderr[-3000:]
    line = (f"grpo-mega train: a second stop signal (SIGTERM): stopped at once without saving step 2; the same "
            f"command resumes from its last checkpoint, {run_dir / 'checkpoints' / 'step_000001'} (step 1)")
    assert _stop_lines(stderr) == [line, line], stderr[-3000:]  # one per rank, as the ranks' other stop lines
    assert "Traceback" not in stderr and "failed (cause=" not in stderr, stderr[-3000:]
    assert seconds < 20, seconds
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
