"""The share of a GRPO run's step seconds that a phase took, from the run's recorded ``metrics.jsonl``: the learned
PRM's scoring (``timing_s/prm``) and the implicit PRM's update and scoring (``timing_s/implicit_prm``), each summed
over the run's steps and divided by the summed ``timing_s/step`` (what the quickstart's arm reports call
``prm_scoring_share`` and ``implicit_prm_share``), with the mean seconds per step.

    python bench/step_shares.py bench/results/pipeline_seeds_sparse_tree_runs/seed*/grpo_process \\
        --json bench/results/prm_share_sparse.json

Each argument is an arm's folder (holding ``metrics.jsonl``) or the file itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASES = {"prm": "timing_s/prm", "implicit_prm": "timing_s/implicit_prm"}


def step_shares(metrics_file: Path) -> dict:
    """{steps, step_seconds_mean, <phase>_share, <phase>_seconds_mean} over the steps of ``metrics_file`` that
    timed a step; a phase the run never timed is left out."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "timing_s/step" in row]
    if not steps:
        raise ValueError(f"{metrics_file}: no row has timing_s/step (not a GRPO run's metrics?)")
    total = sum(row["timing_s/step"] for row in steps)
    figures = {"steps": len(steps), "step_seconds_mean": round(total / len(steps), 4)}
    for phase, key in PHASES.items():
        seconds = sum(row.get(key, 0.0) for row in steps)
        if any(key in row for row in steps):
            figures[f"{phase}_share"] = round(seconds / total, 4)
            figures[f"{phase}_seconds_mean"] = round(seconds / len(steps), 4)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="arm folders (with metrics.jsonl) or metrics files")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    results = {}
    for run in args.runs:
        path = run / "metrics.jsonl" if run.is_dir() else run
        if not path.is_file():
            parser.error(f"{path}: no such file")
        results[str(run)] = figures = step_shares(path)
        shown = ", ".join(f"{name} {value}" for name, value in figures.items())
        print(f"{run}: {shown}")
    for phase in PHASES:
        shares = [figures[f"{phase}_share"] for figures in results.values() if f"{phase}_share" in figures]
        if len(shares) > 1:
            print(f"{phase} share over {len(shares)} runs: mean {statistics.mean(shares):.4f}, "
                  f"range {min(shares):.4f}-{max(shares):.4f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"command": "python bench/step_shares.py " + " ".join(map(str, args.runs)),
                                         "runs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
