"""Does one-step-stale training learn what synchronous training learns? The quickstart's outcome-supervised GRPO
arm (dense regime: data -> SFT -> GRPO) over seeds, run twice from the same SFT checkpoint with the same seed,
steps and data: colocated (2 processes, DP2, as ``grpo-mega quickstart`` runs it) and ``rollout.mode: async`` with
``rollout.max_staleness: 1`` and truncated importance sampling (1 training + 1 rollout process).

    .venv/bin/python bench/async_learning.py [--seeds 1 2 3] [--out runs/async_learning]

Per seed: the held-out accuracy of SFT and of each arm after GRPO, the arms' wall seconds; then the seed-by-seed
difference async - colocated with its mean, standard deviation and standard error. Writes
bench/results/async_learning.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo_mega.quickstart.pipeline import DENSE, run_pipeline  # noqa: E402
from grpo_mega.run.metrics import read_metrics  # noqa: E402

ASYNC = ["rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_is=tis", "parallel.tensor=1"]


def final_accuracy(run_dir: Path) -> float:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    return rows[-1]["eval/accuracy"]


def run_seed(seed: int, out: Path) -> dict:
    seed_dir = out / f"seed{seed}"
    summary = run_pipeline(seed_dir, replace(DENSE, seed=seed, process_supervision=False))
    colocated = seed_dir / "grpo"
    async_dir = seed_dir / "grpo_async"
    begin = time.perf_counter()
    # the colocated arm's resolved config, run again in async mode (same init_from, data, seed, steps, eval)
    subprocess.run([sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(colocated / "config.yaml"),
                    "--nproc", "2", f"trainer.run_dir={async_dir}", "trainer.progress_bar=false", *ASYNC],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(seed_dir / "grpo_async.log", "w"))
    async_seconds = time.perf_counter() - begin
    rows = read_metrics(async_dir / "metrics.jsonl")
    return {"seed": seed, "sft_accuracy": summary["sft_accuracy"], "colocated_accuracy": final_accuracy(colocated),
            "async_accuracy": final_accuracy(async_dir), "colocated_seconds": summary["stage_seconds"]["grpo"],
            "async_seconds": round(async_seconds, 1),
            "async_trainer_wait_s_mean": statistics.mean(r["async/trainer_wait_s"] for r in rows if r["step"] > 0),
            "steps": summary["steps"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "async_learning")
    parser.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "async_learning.json")
    args = parser.parse_args(argv)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.out))
        print(json.dumps(runs[-1]), flush=True)
    differences = [r["async_accuracy"] - r["colocated_accuracy"] for r in runs]
    mean = statistics.mean(differences)
    sd = statistics.stdev(differences) if len(differences) > 1 else 0.0
    spread = {arm: {"mean": statistics.mean(r[f"{arm}_accuracy"] for r in runs),
                    "sd": statistics.stdev(r[f"{arm}_accuracy"] for r in runs) if len(runs) > 1 else 0.0,
                    "min": min(r[f"{arm}_accuracy"] for r in runs), "max": max(r[f"{arm}_accuracy"] for r in runs)}
              for arm in ("sft", "colocated", "async")}
    record = {"runs": runs, "spread": spread,
              "async_minus_colocated": {"differences": differences, "mean": mean, "sd": sd,
                                        "se": sd / len(differences) ** 0.5},
              "command": "python bench/async_learning.py --seeds " + " ".join(map(str, args.seeds))}
    args.result.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["spread"]), json.dumps(record["async_minus_colocated"]))
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
