"""Node loss on the two-node SLURM job, over trials (issue 37): tests/test_slurm_two_nodes.py's
``test_a_two_node_job_stops_on_usr1_then_survives_the_loss_of_either_node`` run ``--trials`` times (after a USR1
stop and its resume, every process of the job on the second node SIGKILLed, then, resumed, those on the first; each
time the job must requeue itself as a transient fault within 2 x the 20 s timeout + torchrun's grace, resume on both
nodes from the last complete checkpoint, and it must complete with every step logged once). A trial's figures are
the second node's loss (the first).

    .venv/bin/python bench/node_loss.py [--trials 5] [--out bench/results/faults.json]

Adds ``faults.node_loss`` (per trial: passed, seconds from the kill to the requeue line, the step resumed from, the
seconds the trial took) to the faults results. Needs root (network namespaces, slurmd), as the test does.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_slurm_two_nodes.py::test_a_two_node_job_stops_on_usr1_then_survives_the_loss_of_either_node"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    parser.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="grpo-node-loss-")),
                        help="each trial's pytest folder (its job log) is kept here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    trials = []
    for number in range(args.trials):
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                 f"--basetemp={args.work / f'trial{number}'}", TEST],
                                cwd=ROOT, capture_output=True, text=True)
        found = re.search(r"node loss \([^)]*\): requeued ([\d.]+) s after the kill; named \[[^]]*\]; "
                          r"resumed from step (\d+)", result.stdout)
        trial = {"trial": number, "passed": result.returncode == 0,
                 "seconds_to_requeue": float(found.group(1)) if found else None,
                 "resumed_from_step": int(found.group(2)) if found else None,
                 "seconds": round(time.monotonic() - start, 1)}
        logs = sorted((args.work / f"trial{number}").rglob("grpo-mega-*.out"))
        if logs:  # the job's own lines: its restarts, the failure lines, the requeue decision
            trial["job_log"] = [line[:200] for line in logs[0].read_text().splitlines()
                                if line.startswith(("===", "srun")) or "failed (cause=" in line]
        if result.returncode != 0:
            trial["output_tail"] = result.stdout[-3000:]
        trials.append(trial)
        print(json.dumps(trial), flush=True)
    seconds = [t["seconds_to_requeue"] for t in trials if t["seconds_to_requeue"] is not None]
    summary = {"trials": len(trials), "passed": sum(t["passed"] for t in trials),
               "seconds_to_requeue_max": max(seconds, default=None),
               "seconds_to_requeue_mean": round(sum(seconds) / len(seconds), 2) if seconds else None}
    results = json.loads(args.out.read_text()) if args.out.exists() else {"faults": {}}
    results.setdefault("faults", {})["node_loss"] = {"summary": summary, "trials": trials,
                                                    "command": "python bench/node_loss.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(summary))
    return 0 if summary["passed"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
