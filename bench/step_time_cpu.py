"""The step-time model (``grpo-mega plan --steps``) against GRPO steps measured on this CPU: fit on half the
configs, judged on the other half.

Every config is ``bench/ours_grpo.py`` (``grpo-mega train`` on 2 gloo processes x 1 thread, hf rollouts, the
workload of ``bench/workload.py``: seeded random Qwen2-shaped weights, temperature 1, no KL, one update per
batch, fp32) for ``--steps`` steps, the first a warm-up; a phase's measured figure is its median over the others
(``timing_s/gen``, ``timing_s/update``, ``timing_s/sync``, ``timing_s/step``). The prediction is the product's
path: the same overrides loaded into a ``GRPOConfig``, ``plan_config`` on 1 node x 2 "GPUs" (the processes), and
``grpo_mega.plan.timing.config_step_time`` on a CPU profile of one core (``bench/matmul_peak.py``'s 1-thread
matmul peak and copy bandwidth, measured in the same run), with the measured mean prompt and response tokens as
its assumptions (a user gives them the same way). The factors of ``grpo_mega.plan.step_time.Efficiency`` are
fitted on the ``fit`` configs (least squares on log seconds over generation, update and the step) and the
``judge`` configs are predicted with them. The machine is shared: the load average before and after each run is
recorded beside it, and a run under load measures the load as much as the code.

    python bench/step_time_cpu.py                 # 10 configs x 4 steps; writes bench/results/step_time_cpu.json
    python bench/step_time_cpu.py --only base     # one config, to check the harness
    python bench/step_time_cpu.py --refit bench/results/step_time_cpu.json --out /tmp/refit.json
                                                  # today's model on a record's measurements (nothing run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

BOUNDS = {"decode_step_overhead": (1e-5, 0.5), "layer_overhead": (1e-6, 0.05), "collective_latency": (1e-6, 0.05)}
"""Seconds factors' ranges (the shares of peak search [0.005, 1])."""


@dataclass(frozen=True)
class CpuConfig:
    name: str
    size: str
    half: str
    """fit or judge."""
    group: int = 8
    max_new: int = 64
    tensor: int = 1
    mode: str = "colocated"
    prompts: int = 16


CONFIGS = [
    CpuConfig("base", "3m", "fit"),
    CpuConfig("1m", "1m", "fit"),
    CpuConfig("25m", "25m", "judge"),
    CpuConfig("g4", "3m", "judge", group=4),
    CpuConfig("g16", "3m", "fit", group=16),
    CpuConfig("len32", "3m", "judge", max_new=32),
    CpuConfig("len128", "3m", "fit", max_new=128),
    CpuConfig("tp2", "3m", "judge", tensor=2),
    CpuConfig("async", "3m", "judge", mode="async"),
    CpuConfig("1m_tp2_g16", "1m", "fit", group=16, tensor=2),
]


def overrides(c: CpuConfig, model_dir: Path, prompt_file: Path) -> list[str]:
    """The config keys bench/ours_grpo.py sets, as key=value (the same for the run and the prediction)."""
    out = [f"parallel.tensor={c.tensor}", "parallel.pipeline=1", f"model.hf_config={model_dir}",
           f"model.init_from={model_dir}", f"data.train_file={prompt_file}", "trainer.save_every=0",
           f"algorithm.rollout_batch_size={c.prompts}", f"algorithm.num_return_sequences_in_group={c.group}",
           f"algorithm.response_length={c.max_new}", "algorithm.dynamic_sampling=false", "algorithm.ppo_epochs=1",
           f"rollout.generation_batch_size={c.prompts}", "parallel.max_tokens_per_micro_batch=1024",
           "reward.function=workload:digit_reward"]
    if c.mode == "async":
        out += ["rollout.mode=async", "rollout.async_ranks=1", "rollout.max_staleness=1", "algorithm.rollout_is=tis"]
    return out


def measure(c: CpuConfig, work: Path, steps: int) -> dict:
    from ours_grpo import run_ours, write_prompt_file
    from workload import build_workload

    built = build_workload(work / "workload", c.size)
    folder = work / c.name
    folder.mkdir(parents=True, exist_ok=True)
    prompt_file = write_prompt_file(built.train_file, c.prompts, folder / "prompts.jsonl")
    extra = [o for o in overrides(c, built.model_dir, prompt_file) if o.startswith(("rollout.mode", "rollout.async",
                                                                                     "rollout.max_stal",
                                                                                     "algorithm.rollout_is"))]
    load_before = os.getloadavg()[0]
    started = time.time()
    raw = run_ours(built.model_dir, prompt_file, folder / "run", num_prompts=c.prompts, group=c.group,
                   max_new=c.max_new, steps=steps, nproc=2, tensor=c.tensor, overrides=tuple(extra))
    rows = raw["steps"][1:]
    if not rows:
        raise RuntimeError(f"{c.name}: {len(raw['steps'])} step(s) logged, nothing after the warm-up")

    def median(key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in rows)

    return {"config": asdict(c), "model_dir": str(built.model_dir), "prompt_file": str(prompt_file),
            "steps_measured": len(rows), "wall_seconds": round(time.time() - started, 1),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "measured": {"generation": median("timing_s/gen"), "update": median("timing_s/update"),
                         "weight_sync": median("timing_s/sync"), "step": median("timing_s/step")},
            "tokens": median("perf/num_tokens"), "response_tokens": median("perf/num_response_tokens")}


def predictor(c: CpuConfig, result: dict):
    """A function Efficiency -> predicted seconds {generation, update, weight_sync, step} for one measured config,
    through the product's path (the plan built once)."""
    import functools

    from grpo_mega.config import GRPOConfig, load_config, validate
    from grpo_mega.plan import plan_config
    from grpo_mega.plan.timing import Assumptions, config_step_time

    cfg = load_config(GRPOConfig, str(ROOT / "configs/quickstart_grpo.yaml"),
                      overrides(c, Path(result["model_dir"]), Path(result["prompt_file"])),
                      functools.partial(validate, world_size=0))
    plan = plan_config(cfg, gpus_per_node=2, gpu_memory_gib=8.0)
    rows = c.prompts * c.group
    response = result["response_tokens"] / rows
    prompt = (result["tokens"] - result["response_tokens"]) / rows
    assumptions = Assumptions(mean_prompt=min(prompt, cfg.data.prompt_length), mean_response=min(response, c.max_new))

    def predict(device, eff) -> dict:
        step, _ = config_step_time(cfg, plan, device, eff, assumptions)
        return {**step.phases, "step": step.seconds}

    return predict


def recorded(path: Path, chosen: list[CpuConfig], work: Path):
    """([(config, result)], the CPU profile, the matmul peak) of an earlier record's measurements, with the
    workload rebuilt under ``work`` (the predictor reads the model's config.json and the prompt file)."""
    from ours_grpo import write_prompt_file
    from workload import build_workload

    from grpo_mega.plan.devices import DeviceProfile

    record = json.loads(path.read_text())
    rows = {row["config"]: row for row in record["configs"]}
    measured = []
    for c in chosen:
        row = rows.get(c.name)
        if row is None or "tokens" not in row:
            raise SystemExit(f"{path}: no measured tokens for config {c.name!r} (records before 2026-12-01 lack "
                             "them: measure again)")
        built = build_workload(work / "workload", c.size)
        folder = work / c.name
        folder.mkdir(parents=True, exist_ok=True)
        prompt_file = write_prompt_file(built.train_file, c.prompts, folder / "prompts.jsonl")
        measured.append((c, {"model_dir": str(built.model_dir), "prompt_file": str(prompt_file),
                             "measured": row["measured"], "tokens": row["tokens"],
                             "response_tokens": row["response_tokens"], "load_average": row["load_average"],
                             "steps_measured": row.get("steps_measured")}))
    return measured, DeviceProfile(**record["cpu_profile"]), record["matmul_peak_1_thread"]


def log_error(items, device, eff) -> float:
    total = 0.0
    for predict, result in items:
        pred = predict(device, eff)
        for key in ("generation", "update", "step"):
            total += (math.log(pred[key]) - math.log(result["measured"][key])) ** 2
    return total


def fit(items, device, rounds: int = 8):
    from grpo_mega.plan.fitting import fit_efficiency

    return fit_efficiency(lambda eff: log_error(items, device, eff), bounds=BOUNDS, default_bounds=(0.005, 1.0),
                          rounds=rounds, searches=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per config, the first a warm-up")
    parser.add_argument("--only", nargs="+", help="config names to run (default: all)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/grpo_mega_step_time_cpu"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/step_time_cpu.json")
    parser.add_argument("--refit", type=Path, metavar="RECORD",
                        help="fit and judge today's model on RECORD's measurements (its CPU profile, tokens and "
                             "seconds) instead of measuring: the workloads are rebuilt, nothing is trained")
    args = parser.parse_args()
    from matmul_peak import matmul_peak, memory_bandwidth

    from grpo_mega.plan.devices import cpu_profile

    started = time.time()
    chosen = [c for c in CONFIGS if not args.only or c.name in args.only]
    if args.refit:
        measured, device, peak = recorded(args.refit, chosen, args.work)
    else:
        peak = matmul_peak(1)
        bandwidth = memory_bandwidth(1)
        device = cpu_profile(peak["gflops"] * 1e9, bandwidth)
        print(f"one core: {peak['gflops']} GFLOP/s, {bandwidth / 1e9:.2f} GB/s (load {peak['load_average']})")
        measured = []
        for c in chosen:
            result = measure(c, args.work, args.steps)
            print(json.dumps({"config": c.name, **result["measured"], "load": result["load_average"]}))
            measured.append((c, result))
    items = {c.name: (predictor(c, r), r) for c, r in measured}
    fit_items = [items[c.name] for c, _ in measured if c.half == "fit"] or list(items.values())
    eff = fit(fit_items, device)
    table = []
    for c, r in measured:
        pred = items[c.name][0](device, eff)
        errors = {k: round(pred[k] / v - 1, 3) for k, v in r["measured"].items() if v > 0 and k in pred}
        table.append({"config": c.name, "half": c.half, "measured": r["measured"],
                      "predicted": {k: round(v, 3) for k, v in pred.items()}, "error": errors,
                      "load_average": r["load_average"], "tokens": r["tokens"],
                      "response_tokens": r["response_tokens"], "steps_measured": r["steps_measured"]})
        print(f"{c.name:<12}{c.half:<6}" + "".join(
            f"{k} {r['measured'][k]:.2f}/{pred[k]:.2f} ({errors.get(k, 0):+.0%})  "
            for k in ("generation", "update", "step")))
    judged = [row for row in table if row["half"] == "judge"]
    floors = {"judged_configs": len(judged),
              "phases_within_25pct": all(abs(row["error"][k]) <= 0.25 for row in judged
                                         for k in ("generation", "update")) if judged else None,
              "step_within_20pct": all(abs(row["error"]["step"]) <= 0.20 for row in judged) if judged else None}
    record = {"what": "step-time model vs measured CPU steps (fit on half, judged on the other half)",
              "measured_in": str(args.refit) if args.refit else "this run",
              "command": "python bench/step_time_cpu.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine_shared": True, "nice": os.nice(0), "cpu_profile": asdict(device), "matmul_peak_1_thread": peak,
              "factors": asdict(eff), "floors": floors, "configs": table,
              "wall_seconds": round(time.time() - started, 1)}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"factors": asdict(eff), "floors": floors}))
    print(args.out)


if __name__ == "__main__":
    main()
