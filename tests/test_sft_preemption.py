"""SFT stops early with a checkpoint as GRPO and PRM training do (the run harness, 2 gloo processes under torchrun,
the real CLI): SIGTERM to torchrun saves the step in flight and exits with status 3, and the same command resumes
it exactly (the same weights and metrics as an uninterrupted run); the time limit does the same."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.run.control import EXIT_STOPPED_EARLY
from grpo_mega.run.metrics import read_metrics
from tiny_task import build_tiny_task

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_sft.yaml"
COMPARED = ("sft/nll", "grad_norm", "lr", "padding_fraction")
"""The metrics of a step that depend on the weights and the batch (not on the clock)."""


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _cli(task, run_dir, *extra):
    model_dir, train_file = task
    # A constant learning rate: the run that stops and the uninterrupted one differ in trainer.total_steps.
    return [sys.executable, "-m", "grpo_mega.cli", "sft", "--config", str(CONFIG), "--nproc", "2",
            f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"trainer.run_dir={run_dir}",
            "trainer.batch_size=8", "trainer.save_every=0", "trainer.progress_bar=false", "trainer.tensorboard=false",
            "optim.decay_style=constant", "optim.warmup_steps=0", "parallel.device=cpu", *extra]


def _stopped_steps(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"grpo-mega sft: stopped after step (\d+)", output)]


def _checkpoint_tensors(folder: Path) -> dict:
    """Every tensor of a training checkpoint (torch_dist = torch.distributed.checkpoint), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent.parent / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_the_resumed_run_equals_an_uninterrupted_one(task, tmp_path):
    import torch

    interrupted = tmp_path / "interrupted"
    log_path = tmp_path / "interrupted.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(_cli(task, interrupted, "trainer.total_steps=1000"), stdout=log, stderr=log)
        metrics = interrupted / "metrics.jsonl"
        while job.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
        code = job.wait(timeout=300)
    output = log_path.read_text()
    steps = _stopped_steps(output)
    assert code != 0 and len(steps) == 2 and steps[0] == steps[1] and 1 <= steps[0] < 1000, output[-3000:]
    assert "SIGTERM received" in output
    stopped = steps[0]
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:06d}"

    last = stopped + 2
    resumed = subprocess.run(_cli(task, interrupted, f"trainer.total_steps={last}"), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and f"step_{stopped:06d}" in resumed.stderr
    straight = subprocess.run(_cli(task, tmp_path / "straight", f"trainer.total_steps={last}"), capture_output=True,
                              text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    expected, got = read_metrics(tmp_path / "straight" / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    assert [row["step"] for row in got] == [row["step"] for row in expected] == list(range(1, last + 1))
    for name in COMPARED:
        assert [row[name] for row in got] == pytest.approx([row[name] for row in expected], rel=1e-6, abs=1e-9), name
    final_a = _checkpoint_tensors(tmp_path / "straight" / "checkpoints" / f"step_{last:06d}")
    final_b = _checkpoint_tensors(interrupted / "checkpoints" / f"step_{last:06d}")
    assert final_a.keys() == final_b.keys() and "embedding.word_embeddings.weight" in final_a
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key


@pytest.mark.slow
def test_the_time_limit_saves_and_stops_with_status_3(task, tmp_path):
    run_dir = tmp_path / "run"
    # less than save_before_seconds is left from the start: the first step stops
    result = subprocess.run(
        _cli(task, run_dir, "trainer.total_steps=40", "trainer.time_limit_seconds=60",
             "trainer.save_before_seconds=3600"),
        capture_output=True, text=True, timeout=600,
    )
    # the launcher exits with the rank's status, without torchrun's banner
    assert result.returncode == EXIT_STOPPED_EARLY and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert _stopped_steps(result.stderr) == [1, 1] and "before the time limit" in result.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1]
