"""The quickstart pipeline over seeds, with all three GRPO arms: outcome supervision, process supervision by the
learned PRM, and process supervision by the task's ground-truth step checker (the oracle PRM).

    .venv/bin/python bench/pipeline_seeds.py [--seeds 1 2 3] [--out runs/pipeline_seeds] [--fast]

Each seed runs the whole pipeline of ``grpo-mega quickstart`` (same data; the seed moves SFT, the PRM's labels and
training, and GRPO) plus the oracle arm, in ``OUT/seed<N>``. Prints one row per seed with the mean, the standard
deviation and the range, the gains over SFT, and writes bench/results/pipeline_seeds.json (path printed last).
About 25 minutes per seed on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.seed_table import report_seeds  # noqa: E402
from grpo_mega.quickstart import FAST, QuickstartPlan, run_pipeline  # noqa: E402

COLUMNS = ("sft_accuracy", "os_accuracy", "ps_accuracy", "oracle_accuracy", "os_gain", "ps_gain", "oracle_gain",
           "prm_f1", "prm_f1_planted")


def with_gains(summary: dict) -> dict:
    """The summary with each arm's held-out gain over the SFT policy (``os_gain``, ``ps_gain``, ``oracle_gain``)."""
    gains = {f"{arm}_gain": summary[f"{arm}_accuracy"] - summary["sft_accuracy"]
             for arm in ("os", "ps", "oracle") if summary.get(f"{arm}_accuracy") is not None}
    return {**summary, **gains}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pipeline_seeds")
    parser.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "pipeline_seeds.json")
    parser.add_argument("--fast", action="store_true", help="the shortened plan of the end-to-end test")
    args = parser.parse_args()
    base = FAST if args.fast else QuickstartPlan()
    results = []
    for seed in args.seeds:
        print(f"== seed {seed}", flush=True)
        results.append(with_gains(run_pipeline(args.out / f"seed{seed}", replace(base, seed=seed, oracle_arm=True))))
    report_seeds(args.seeds, results, COLUMNS, args.result, width=16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
