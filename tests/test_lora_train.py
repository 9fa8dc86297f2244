"""``grpo-mega train`` with ``model.lora`` from the command line (one process, the tiny task): the run logs its
trainable parameters, trains with the KL loss against the base (0 at the first step, while B is zero, then not), its
checkpoints hold the adapters and name the base, and a run resumed from its step-1 checkpoint repeats its step 2
bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiny_task import SMALL_RUN, build_tiny_task

REPO = Path(__file__).resolve().parent.parent
ONE_PROCESS = [item for item in SMALL_RUN if not item.startswith("parallel.tensor")]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The tiny task, its model folder holding random HF weights (the base), and a reward that varies."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("task")
    model_dir, train_file = build_tiny_task(root)
    base = root / "base"
    shutil.copytree(model_dir, base)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base)).save_pretrained(base)
    reward = root / "parity.py"
    reward.write_text(textwrap.dedent("""
        def reward(completions, **kwargs):  # random weights write text of any length: rewards that differ
            return [float(len(completion) % 2) for completion in completions]
    """))
    return base, train_file, reward


def _train(task, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    base, train_file, reward = task
    return subprocess.run(
        [sys.executable, "-m", "grpo_mega.cli", "train", "--config", "configs/quickstart_grpo.yaml",
         f"model.hf_config={base}", f"model.init_from={base}", f"data.train_file={train_file}",
         f"trainer.run_dir={run_dir}", f"reward.function={reward}:reward", "trainer.total_steps=2",
         "trainer.save_every=1", "trainer.keep_last=2", "model.lora.rank=4", "model.lora.alpha=8", "algorithm.use_kl_loss=true",
         "algorithm.kl_loss_coef=0.1", "optim.lr=1e-2", "trainer.eval_every=0", *ONE_PROCESS, *extra],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "actor/loss" in row}


@pytest.mark.slow
def test_a_lora_run_trains_against_its_base_and_resumes_bit_equal(task, tmp_path):
    first = _train(task, tmp_path / "run")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "LoRA rank 4 (alpha 8) on linear_qkv, linear_proj, linear_fc1, linear_fc2:" in first.stderr
    steps = _steps(tmp_path / "run")
    assert steps[1]["actor/kl_loss"] == 0.0 < steps[2]["actor/kl_loss"]  # B = 0 at step 1: the base exactly
    step1 = tmp_path / "run" / "checkpoints" / "step_000001"
    info = json.loads((step1 / "grpo_mega_checkpoint.json").read_text())
    assert info["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1",
                                                                        "linear_fc2"],
                            "adapters_only": True, "base": str(task[0])}
    weights = sum(path.stat().st_size for path in task[0].glob("*.safetensors"))
    saved = sum(path.stat().st_size for path in step1.rglob("*") if path.is_file())
    assert saved < weights / 4  # adapters and their Adam moments, not the model

    resumed = _train(task, tmp_path / "resumed", f"trainer.resume={step1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _steps(tmp_path / "resumed")
    assert list(again) == [2]
    deterministic = [key for key in steps[2] if key.startswith(("actor/", "reward", "score"))]
    assert "actor/grad_norm" in deterministic
    assert {key: again[2][key] for key in deterministic} == {key: steps[2][key] for key in deterministic}
