"""`grpo-mega plan --steps` on bench/gpu_check.py's GRPO config predicts what one H200 measured
(bench/results/gpu_check_h200.json: step 8.9-10.5 s, generation 7.6-9.5 s, update 1.0-1.3 s) within 30 %: the
shipped GPU factors are fitted on those steps together with the published rows (bench/step_time_gpu.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from step_time_gpu import GPU_CHECK_RESULT, gpu_check_overrides, measured_steps  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The H200 run's policy config (random Qwen2.5-0.5B-shaped weights, the synthetic task's special tokens)."""
    folder = tmp_path_factory.mktemp("gpu_check_model")
    config = json.loads(GPU_CHECK_RESULT.read_text())["stages"]["task"]["config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("step", measured_steps(), ids=lambda s: f"step{s['step']}")
def test_plan_steps_predicts_the_h200_gpu_check_step_within_30_percent(model_dir, step, capsys):
    from grpo_mega.cli import main

    code = main(["plan", "--config", "configs/quickstart_grpo.yaml", "--steps", "3", "--device", "H200",
                 "--gpus-per-node", "1", "--gpu-memory-gib", "139.8", "--gpu-name", "NVIDIA H200", "--json",
                 "--mean-prompt", f"{step['mean_prompt']:.2f}", "--mean-response", f"{step['mean_response']:.2f}",
                 *gpu_check_overrides(model_dir)])
    assert code in (0, 1), capsys.readouterr().err  # 1: the plan's verdict, not an error
    timed = json.loads(capsys.readouterr().out)["step_time"]
    predicted = {name: phase["seconds"] for name, phase in timed["phases"].items()}
    predicted["step"] = timed["step_seconds"]
    for phase, measured in step["measured"].items():
        assert predicted[phase] / measured == pytest.approx(1.0, abs=0.30), (phase, predicted[phase], measured)
    # the small-policy note names the run it was priced from
    assert any("gpu_check_h200.json" in note for note in timed["notes"])
