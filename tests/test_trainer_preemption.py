"""Stopping early with a checkpoint (2 gloo processes under torchrun, the real CLI): SIGTERM to torchrun, a
signal that reaches one rank only, and the time limit; the run exits with status 3 and resumes from that step."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo_mega.run.control import EXIT_STOPPED_EARLY
from grpo_mega.run.forked_ranks import rank_process_name
from grpo_mega.run.metrics import read_metrics
from grpo_mega.run.shared_fork_server import without_offer
from tiny_task import build_tiny_task, tiny_run_overrides

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _cli(task, run_dir, *extra):
    return [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "--nproc", "2",
            *tiny_run_overrides(task, run_dir, "trainer.save_every=0", *extra)]


def _start_and_signal_after_step_one(task, run_dir, send, env=None):
    """Start a 40-step run, wait until step 1 is logged, call ``send(job)``; returns (return code, output)."""
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(_cli(task, run_dir, "trainer.total_steps=40"), stdout=log, stderr=log, env=env)
        metrics = run_dir / "metrics.jsonl"
        while job.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        send(job)
        code = job.wait(timeout=300)
    return code, log_path.read_text()


def _stopped_steps(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"grpo-mega train: stopped after step (\d+)", output)]


def _resumes_from(task, run_dir, step: int) -> None:
    resumed = subprocess.run(_cli(task, run_dir, f"trainer.total_steps={step + 1}"), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step_{step:06d}" in resumed.stderr and "resumed from" in resumed.stderr
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, step + 2))


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_the_step_in_flight_and_stops(task, tmp_path):
    run_dir = tmp_path / "run"
    code, output = _start_and_signal_after_step_one(task, run_dir, lambda job: job.send_signal(signal.SIGTERM))
    steps = _stopped_steps(output)
    assert code != 0 and len(steps) == 2 and steps[0] == steps[1] and 1 <= steps[0] < 40, output[-3000:]
    assert "SIGTERM received" in output
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps[0]:06d}"
    _resumes_from(task, run_dir, steps[0])


@pytest.mark.slow
def test_a_signal_seen_by_one_rank_stops_every_rank_at_the_same_step(task, tmp_path):
    run_dir = tmp_path / "run"

    def signal_rank_one_only(job):
        # a rank forked from the preloaded server (CPU torch: grpo_mega.run.forked_ranks) is known by its name;
        # one torchrun started as an interpreter, by its command line and environment
        processes = psutil.Process(job.pid).children(recursive=True)
        rank_one = [p for p in processes if p.name() == rank_process_name("1") or (
            "grpo_mega.cli" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1")]
        assert len(rank_one) == 1, [(p.name(), p.cmdline()) for p in processes]
        rank_one[0].send_signal(signal.SIGUSR1)

    # without the suite's shared fork server: rank 1 is found among the job's descendants
    code, output = _start_and_signal_after_step_one(task, run_dir, signal_rank_one_only, env=without_offer())
    steps = _stopped_steps(output)
    assert code != 0 and len(steps) == 2 and steps[0] == steps[1] < 40, output[-3000:]
    assert "SIGUSR1 received" in output and "a signal on another rank" in output
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps[0]:06d}"


@pytest.mark.slow
def test_the_time_limit_saves_and_stops_with_status_3(task, tmp_path):
    run_dir = tmp_path / "run"
    # 60 s of limit from the start, stop with 600 s left: less than that is left after any first step, however fast
    # the machine (a 1 s limit with 0.5 s left let a fast machine's start-up and first step through)
    result = subprocess.run(
        _cli(task, run_dir, "trainer.total_steps=40", "trainer.time_limit_seconds=60", "trainer.save_before_seconds=600"),
        capture_output=True, text=True, timeout=600,
    )
    # the launcher exits with the rank's status, without torchrun's banner
    assert result.returncode == EXIT_STOPPED_EARLY and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert _stopped_steps(result.stderr) == [1, 1] and "before the time limit" in result.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    _resumes_from(task, run_dir, 1)


def test_stop_requests_in_one_process():
    import os

    import torch

    from grpo_mega.run.control import StopRequests, job_end_time

    cpu = torch.device("cpu")
    assert StopRequests(save_before_seconds=10, end_time=time.time() + 3600).agreed_reason(cpu) is None
    assert "time limit" in StopRequests(save_before_seconds=10, end_time=time.time() + 5).agreed_reason(cpu)
    assert StopRequests(save_before_seconds=0, end_time=time.time()).agreed_reason(cpu) is None  # 0 disables
    previous = signal.getsignal(signal.SIGUSR1)
    requests = StopRequests().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requests.agreed_reason(cpu) == "SIGUSR1 received"
    finally:
        requests.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert job_end_time({"SLURM_JOB_END_TIME": "1700000000"}) == 1700000000.0 and job_end_time({}) is None
