"""The PRM on the synthetic task, over seeds: Monte-Carlo labels -> PRM training -> evaluation, from a quickstart
policy (``make demo`` leaves one in runs/quickstart: model/, sft/, data/).

    .venv/bin/python bench/prm_synthetic.py [--policy-run runs/quickstart] [--seeds 1234 1 2] [--out DIR]

Prints a table (label agreement with the truth, ProcessBench F1 on planted errors and on the policy's own
solutions, prm@8 / maj@8 / pass@8, minutes) and writes bench/results/prm_synthetic.json (path printed last).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.seed_table import report_seeds  # noqa: E402
from prm.pipeline import PolicyRun, PRMPlan, run_prm_pipeline  # noqa: E402

COLUMNS = ("label_agreement", "step_accuracy", "processbench_f1", "policy_processbench_f1", "prm_at_n", "maj_at_n",
           "pass_at_n", "label_train_eval_seconds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy-run", type=Path, default=ROOT / "runs" / "quickstart")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "prm_bench")
    parser.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "prm_synthetic.json")
    args = parser.parse_args()
    run = args.policy_run.resolve()
    if not (run / "sft").is_dir():
        print(f"{run} has no sft/ policy: run `make demo` (or `grpo-mega quickstart --run-dir {run}`) first",
              file=sys.stderr)
        return 2
    policy = PolicyRun(model_dir=run / "model", weights=run / "sft", train_file=run / "data" / "train.jsonl",
                       heldout_file=run / "data" / "heldout.jsonl")
    results = []
    for seed in args.seeds:
        print(f"seed {seed}", flush=True)
        results.append(run_prm_pipeline(policy, args.out / f"seed{seed}", PRMPlan(), seed=seed))
    report_seeds(args.seeds, results, COLUMNS, args.result, width=26)
    return 0


if __name__ == "__main__":
    sys.exit(main())
