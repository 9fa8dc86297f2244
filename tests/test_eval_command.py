"""``grpo-mega eval``: a checkpoint's held-out figures without training, equal to what the GRPO run logged for the
same weights and seed, from the real CLI; bad input named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.run.metrics import read_metrics
from tiny_task import build_tiny_task, tiny_run_overrides

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"


def digit_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """Share of digits in the completion: a figure that differs between samples even for a random policy."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "grpo_mega.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step GRPO run that evaluated at steps 0 and 1 (sampling at temperature 1) and saved step 1."""
    task = build_tiny_task(tmp_path_factory.mktemp("task"))
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    settings = [*tiny_run_overrides(task, run_dir, "parallel.tensor=1", "trainer.total_steps=1", "trainer.eval_every=1",
                                    f"data.eval_file={task[1].parent / 'heldout.jsonl'}", "data.max_eval_prompts=6",
                                    "trainer.eval_temperature=1.0", "reward.function=test_eval_command:digit_reward")]
    result = _run("train", "--config", str(CONFIG), *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, settings


def test_a_checkpoint_evaluates_to_what_its_run_logged_with_the_same_seed(trained, tmp_path):
    run_dir, settings = trained
    logged = {row["step"]: row["eval/accuracy"] for row in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in row}
    assert set(logged) == {0, 1}
    out = tmp_path / "report.json"
    result = _run("eval", "--config", str(CONFIG), "--policy", str(run_dir / "checkpoints" / "step_000001"),
                  "--samples", "2", "--out", str(out), *settings)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    # sample k draws with parallel.seed + k: sample 1 is the run's own evaluation after step 1, bit for bit
    assert report["accuracy_per_sample"][1] == logged[1]
    assert report["accuracy_per_sample"][0] != report["accuracy_per_sample"][1]  # another draw at temperature 1
    assert report["weights_format"] == "training_checkpoint" and report["prompts"] == 6 and report["samples"] == 2
    assert report["accuracy_mean"] == pytest.approx(sum(report["accuracy_per_sample"]) / 2)
    assert f"accuracy {report['accuracy_mean']:.3f} +- " in result.stdout and result.stdout.splitlines()[-1] == str(out)


def test_a_config_without_held_out_prompts_is_refused_naming_the_key(trained):
    run_dir, settings = trained
    result = _run("eval", "--config", str(CONFIG), "--policy", str(run_dir), *settings, "data.eval_file=null")
    assert result.returncode == 2 and "needs data.eval_file" in result.stderr
