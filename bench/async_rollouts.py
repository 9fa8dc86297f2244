"""Step time of the two rollout modes on the same work (issue 38): colocated (every process generates, then every
process trains) against asynchronous rollouts (``rollout.mode: async``: one process generates while the other
trains, ``rollout.max_staleness`` steps ahead), both with 2 processes on this machine's cores.

The work is the quickstart's GRPO task and policy (Qwen2-shaped, random weights: every completion runs to
``algorithm.response_length``), the same prompts, G, lengths and seed in both modes; a reward that varies within
every group (the share of digits) so every step updates. Each mode runs ``--steps`` steps; the first
``--warmup`` are dropped (start-up, first allocations). Per mode: the mean step time (the trainer's wall time per
step: the ``time`` column of metrics.jsonl), where the trainer's time goes (``timing_s/*``), and for async the
rollout process's generation seconds, how long each side waited for the other, and the overlap share: the
generation seconds hidden behind training, ``1 - trainer_wait / generation``.

On 2 CPU cores the two modes do not get the same compute per phase: colocated, generation and the update each use
both processes (DP2); async, each phase has one process. Async wins when generation and update take similar
time and loses where one dominates; the figures say which. The GPU model (``gpu_model``) is arithmetic over assumed
generation shares and decode scaling, not a measurement: see its docstring.

    python bench/async_rollouts.py               # ~5 min on 2 cores; writes bench/results/async_rollouts.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "quickstart_grpo.yaml"


def run_mode(task: dict[str, Path], run_dir: Path, mode: str, args) -> list[dict]:
    common = [f"model.hf_config={task['model']}", f"data.train_file={task['train']}", f"trainer.run_dir={run_dir}",
              f"trainer.total_steps={args.steps}", "trainer.save_every=0", "trainer.progress_bar=false",
              "trainer.tensorboard=false", "parallel.device=cpu", "parallel.tensor=1",
              f"algorithm.rollout_batch_size={args.prompts}", f"algorithm.num_return_sequences_in_group={args.group}",
              f"algorithm.response_length={args.response_length}", "algorithm.dynamic_sampling=false",
              "algorithm.rollout_is=tis", "reward.function=workload:digit_reward"]
    if mode != "colocated":
        common += ["rollout.mode=async", f"rollout.max_staleness={mode.removeprefix('async_k')}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "--nproc", "2", *common],
                   check=True, env=env, cwd=ROOT, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 1]


def summarize(rows: list[dict], warmup: int) -> dict[str, float]:
    """Mean step seconds (from the metrics rows' times) and the mean of every timing / async metric."""
    kept = [r for r in rows if r["step"] > warmup]
    times = {r["step"]: r["time"] for r in rows}
    step_seconds = [times[r["step"]] - times[r["step"] - 1] for r in kept if r["step"] - 1 in times]
    out = {"steps_measured": len(step_seconds), "step_s_mean": statistics.mean(step_seconds),
           "step_s_sd": statistics.stdev(step_seconds) if len(step_seconds) > 1 else 0.0}
    for key in sorted({k for r in kept for k in r if k.startswith(("timing_s/", "async/"))}):
        values = [r[key] for r in kept if key in r]
        out[key] = statistics.mean(values)
    if "async/generation_s" in out:
        out["overlap_share"] = max(0.0, 1.0 - out["async/trainer_wait_s"] / out["async/generation_s"])
    return out


def gpu_model(generation_share: float, decode_scaling: float, gpus: int = 8, transfer_share: float = 0.02) -> dict:
    """Step-time ratio colocated / async (k >= 1) on ``gpus`` GPUs: arithmetic, not a measurement (no GPU has run
    this code). Inputs: the share ``g`` of the colocated step spent generating (the rest trains), and how generation
    time grows when fewer GPUs generate the same batch, ``(gpus / rollout_gpus) ** decode_scaling``: 1 = linear
    (compute-bound), below 1 = each GPU decodes a larger batch more efficiently (decoding is memory-bound: a vLLM
    replica's tokens/s grows with its batch until the KV cache or compute limits it). Training scales linearly. The
    weight transfer costs ``transfer_share`` of the colocated step on the critical path. Async's steady-state step is
    the slower side plus the transfer; the split of GPUs is the best one for the inputs. With linear scaling the best
    split only ties colocated (the work is the same, only rearranged); the speed-up comes from generation's
    sub-linear scaling and from what the model leaves out: colocated mode's sleep / wake and weight sync, and the
    idle GPUs of its long generation tail (async overlaps the tail with training)."""
    g = generation_share
    best = None
    for rollout_gpus in range(1, gpus):
        training = gpus - rollout_gpus
        step = max(g * (gpus / rollout_gpus) ** decode_scaling, (1 - g) * gpus / training) + transfer_share
        if best is None or step < best[1]:
            best = (rollout_gpus, step)
    return {"generation_share": g, "decode_scaling": decode_scaling, "gpus": gpus, "best_rollout_gpus": best[0],
            "speed_up": round(1.0 / best[1], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--modes", nargs="+", default=["colocated", "async_k0", "async_k1"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async_rollouts.json")
    args = parser.parse_args(argv)

    from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        model, train_file, _ = build_data_and_model(root / "task", QuickstartPlan(num_train=256, num_heldout=8))
        task = {"model": model, "train": train_file}
        for mode in args.modes:
            results[mode] = summarize(run_mode(task, root / mode, mode, args), args.warmup)
            print(mode, json.dumps({k: round(v, 3) for k, v in results[mode].items()}), flush=True)
    colocated = results.get("colocated", {}).get("step_s_mean")
    for mode, summary in results.items():
        if colocated:
            summary["speed_up_vs_colocated"] = colocated / summary["step_s_mean"]
    record = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "workload": {"prompts": args.prompts, "group": args.group, "response_length": args.response_length,
                     "steps": args.steps, "warmup": args.warmup, "processes": 2,
                     "model": "quickstart policy (random weights)"},
        "modes": results,
        "gpu_model": [gpu_model(g, a) for g in (0.5, 0.6, 0.7) for a in (1.0, 0.7, 0.5)],
        "published": {"verl one-step off-policy, Qwen2.5-Math-7B DAPO, 16 GPUs (s/step)": [699, 566],
                      "verl fully async, 32 GPUs (s/step)": [790, 295],
                      "NeMo-RL v0.5 one-step off-policy, Llama-3.1-8B (tokens/s/GPU)": [1581, 2478]},
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
