"""The step-time model's GPU factors fitted on the published rows together with this project's own GPU runs (issue 77,
part 4): the efficiencies that ``Efficiency()`` ships (grpo_mega/plan/step_time.py).

Rows: the seven published runs of ``bench/step_time_published.py`` (their assumptions), and each GRPO step of
``bench/results/gpu_check_h200.json`` (one H200, a random Qwen2.5-0.5B-shaped policy in bf16, the hf rollout engine,
32 prompts x 8, responses up to 64 tokens, ``parallel.max_tokens_per_micro_batch`` 8192): its generation and
update seconds, predicted by the planner itself (``config_step_time`` on the gpu_check config, the step's measured
mean prompt and response tokens, ``grpo-mega plan``'s memory plan for one H200) as ``grpo-mega plan --steps`` does.

The loss is the published script's (the sum of squared log errors over every published phase figure) plus the same
over the H200 steps' generation and update seconds; all seven factors move, by the same coordinate descent and
bounds, starting from the shipped ``Efficiency()``. Reported: the factors, every row's in-sample error, the H200
predicted with the factors shipped before (the published rows' alone, no fixed costs: ~24x under), and each published
row left out of the joint fit.

    python bench/step_time_gpu.py      # ~10 min at load average 30; writes bench/results/step_time_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from step_time_published import ASSUMPTIONS, BOUNDS, ROWS, errors, log_error, predict  # noqa: E402

from grpo_mega.plan.fitting import fit_efficiency  # noqa: E402
from grpo_mega.plan.step_time import Efficiency  # noqa: E402

GPU_CHECK_RESULT = ROOT / "bench/results/gpu_check_h200.json"
GPU_BOUNDS = {**BOUNDS, "layer_overhead": (1e-7, 0.05), "eager_decode_overhead": (1e-7, 0.05),
              "optimizer_step_overhead": (1e-4, 5.0)}
"""The published script's ranges; the optimizer step's fixed cost 0.1 ms - 5 s, the per-layer fixed costs up to 50 ms
(on a GPU they overlap the device's work, so a large model's rows do not see them, and the hf engine's eager decode
on the H200 cost ~6 ms per layer-step)."""
PREVIOUS = Efficiency(mfu_train=0.648, mfu_forward=0.300, decode_bandwidth=0.539, comm=0.289,
                      decode_step_overhead=0.0037, layer_overhead=0.0, eager_decode_overhead=0.0,
                      optimizer_step_overhead=0.0, collective_latency=0.0)
"""The factors shipped before this fit: the published rows' alone (bench/results/step_time_published.json), no fixed
costs (the published rows cannot tell them: vLLM, 7-8B models whose kernels hide the launches)."""
FITTED_PHASES = ("generation", "update")
"""The H200 phases in the loss (the weight sync, 15 ms, is a few per mille of the step)."""


def gpu_check_overrides(model_dir: str | Path, micro_tokens: int = 8192) -> list[str]:
    """``grpo-mega plan`` overrides of configs/quickstart_grpo.yaml that make bench/gpu_check.py's GRPO config on a
    GPU (bench/gpu_check_runs._grpo_arguments with gpu_check._settings("cuda"))."""
    return [f"model.hf_config={model_dir}", "parallel.device=cuda", "algorithm.rollout_batch_size=32",
            "algorithm.num_return_sequences_in_group=8", "algorithm.response_length=64",
            "algorithm.dynamic_sampling=false", f"parallel.max_tokens_per_micro_batch={micro_tokens}",
            "trainer.eval_every=0", "data.train_file=train.jsonl"]


def measured_steps(path: Path = GPU_CHECK_RESULT) -> list[dict]:
    """Each GRPO step of a gpu_check report: measured seconds per phase and mean prompt / response tokens."""
    report = json.loads(path.read_text())
    settings = report["meta"]["settings"]
    rows = settings["rollout_batch"] * settings["group"]
    steps = []
    for step in report["stages"]["grpo"]["steps"]:
        response = step["perf/num_response_tokens"] / rows
        steps.append({"step": step["step"], "mean_prompt": step["perf/num_tokens"] / rows - response,
                      "mean_response": response,
                      "measured": {"generation": step["timing_s/gen"], "update": step["timing_s/update"],
                                   "step": step["timing_s/step"]}})
    return steps


class GPUCheckRow:
    """The planner's step time of the gpu_check config on one H200, for any :class:`Efficiency`."""

    def __init__(self, work: Path, path: Path = GPU_CHECK_RESULT):
        from grpo_mega.config import GRPOConfig, load_config
        from grpo_mega.plan import plan_config
        from grpo_mega.plan.devices import device_profile

        report = json.loads(path.read_text())
        model_dir = work / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(report["stages"]["task"]["config"]))
        self.cfg = load_config(GRPOConfig, ROOT / "configs/quickstart_grpo.yaml", gpu_check_overrides(model_dir))
        gpu = report["stages"]["environment"]
        self.plan = plan_config(self.cfg, gpus_per_node=1, gpu_memory_gib=gpu["gpu_memory_gib"], gpu_name=gpu["gpu"])
        self.device = device_profile(gpu["gpu"])
        self.steps = measured_steps(path)
        self.model_dir = model_dir

    def predict(self, eff: Efficiency, step: dict) -> dict[str, float]:
        from grpo_mega.plan.timing import Assumptions, config_step_time

        timed, _ = config_step_time(self.cfg, self.plan, self.device, eff,
                                    Assumptions(mean_prompt=step["mean_prompt"], mean_response=step["mean_response"]))
        return {**timed.phases, "step": timed.seconds}

    def log_error(self, eff: Efficiency) -> float:
        import math

        total = 0.0
        for step in self.steps:
            predicted = self.predict(eff, step)
            total += sum((math.log(predicted[k]) - math.log(step["measured"][k])) ** 2 for k in FITTED_PHASES)
        return total


def fit(rows, gpu: GPUCheckRow | None, a: dict = ASSUMPTIONS, rounds: int = 12) -> Efficiency:
    """The published script's fit, with the gpu_check steps' squared log errors added to its loss."""
    def loss(eff: Efficiency) -> float:
        return log_error(rows, eff, a) + (gpu.log_error(eff) if gpu is not None else 0.0)

    return fit_efficiency(loss, bounds=GPU_BOUNDS, default_bounds=(0.02, 1.0), rounds=rounds, searches=40)


def gpu_errors(gpu: GPUCheckRow, eff: Efficiency) -> list[dict]:
    out = []
    for step in gpu.steps:
        predicted = gpu.predict(eff, step)
        out.append({"step": step["step"], "measured": step["measured"],
                    "predicted": {k: round(predicted[k], 3) for k in step["measured"]},
                    "error": {k: round(predicted[k] / v - 1, 3) for k, v in step["measured"].items()}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/step_time_gpu.json")
    parser.add_argument("--no-leave-one-out", action="store_true", help="the joint fit only")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        gpu = GPUCheckRow(Path(folder))
        joint = fit(ROWS, gpu)
        result = {
            "what": "the step-time model's GPU factors: published rows and the gpu_check H200 steps fitted together",
            "command": "python bench/step_time_gpu.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu_rows": str(GPU_CHECK_RESULT.relative_to(ROOT)), "fitted_phases": list(FITTED_PHASES),
            "factors": {k: float(f"{v:.4g}") for k, v in asdict(joint).items()},
            "factors_before": {k: float(f"{v:.4g}") for k, v in asdict(PREVIOUS).items()},
            "in_sample": {
                "published": {row.name: {k: round(v, 3)
                                         for k, v in errors(row, predict(row, joint, ASSUMPTIONS)).items()}
                              for row in ROWS},
                "gpu_check_h200": gpu_errors(gpu, joint)},
            "gpu_check_h200_with_the_factors_before": gpu_errors(gpu, PREVIOUS),
        }
        if not args.no_leave_one_out:
            loo = []
            for i, row in enumerate(ROWS):
                eff = fit(ROWS[:i] + ROWS[i + 1:], gpu)
                loo.append({"row": row.name, "error": {k: round(v, 3) for k, v in
                                                       errors(row, predict(row, eff, ASSUMPTIONS)).items()}})
            result["published_left_out_of_the_joint_fit"] = loo
    result["seconds"] = round(time.time() - started, 1)
    result["load_average"] = round(os.getloadavg()[0], 2)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("factors", "factors_before")}, indent=1))
    for entry in result["in_sample"]["gpu_check_h200"]:
        print("H200 step", entry["step"], entry["error"])
    for name, error in result["in_sample"]["published"].items():
        print(f"{name:<32} {error}")
    print(args.out)


if __name__ == "__main__":
    main()
