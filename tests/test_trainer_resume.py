"""`grpo-mega train` resumes from its newest complete checkpoint after the job stops, and rejects bad config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.quickstart import QuickstartPlan, build_data_and_model

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"


def _train(run_dir, model_dir, train_file, total_steps, *extra):
    return subprocess.run(
        [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "--nproc", "2",
         f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"trainer.run_dir={run_dir}",
         f"trainer.total_steps={total_steps}", "trainer.save_every=1", "trainer.progress_bar=false",
         "algorithm.rollout_batch_size=4", "algorithm.num_return_sequences_in_group=2",
         "algorithm.response_length=12", *extra],
        capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_train_resumes_where_it_stopped(tmp_path):
    model_dir, train_file, _ = build_data_and_model(tmp_path, QuickstartPlan(num_train=200, num_heldout=8))
    run_dir = tmp_path / "grpo"
    first = _train(run_dir, model_dir, train_file, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(run_dir, model_dir, train_file, 3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step_000002" in second.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the second job ran only step 3
    assert (run_dir / "checkpoints" / "step_000003").is_dir()


def test_unknown_config_key_fails_at_start_naming_the_key(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "algorithm.not_a_key=1",
         "model.hf_config=x", "data.train_file=y"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "algorithm.not_a_key" in result.stderr
