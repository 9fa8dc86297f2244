"""GRPO step time and tokens/s per phase, from the trainer's own per-step metrics.

Runs ``grpo-mega train`` with ``configs/quickstart_grpo.yaml`` (TP=2 on 2 processes, hf rollouts) for ``--steps``
steps on the synthetic task (a fresh tiny policy, or ``--quickstart DIR`` to start from that quickstart's SFT
policy, its model and data), then summarises
``metrics.jsonl`` over the steps after the first (warm-up): mean seconds per phase (``timing_s/*``) and
tokens/s per phase (generation: response tokens / gen seconds; update and log-prob passes: all tokens / seconds).

    python bench/grpo_step.py --steps 6 --out bench/results/grpo_step.json [--quickstart runs/quickstart]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model  # noqa: E402
from grpo_mega.run.metrics import read_metrics  # noqa: E402


def summarise(rows: list[dict]) -> dict:
    """Mean phase seconds and tokens/s over ``rows`` (per-step metrics). ValueError when no measured step updated
    the policy (dynamic sampling dropped every group, as on a random-weight model): there is nothing to time."""
    rows = [row for row in rows if "perf/num_tokens" in row and "timing_s/update" in row]
    if not rows:
        raise ValueError("no measured step trained (every group dropped as zero-signal?): start from a policy that "
                         "solves some prompts (--quickstart RUN) or pass algorithm.dynamic_sampling=false")

    def mean(key):
        values = [row[key] for row in rows if key in row]
        return sum(values) / len(values) if values else None

    phases = {key[len("timing_s/"):]: round(mean(key), 3) for key in sorted({k for r in rows for k in r})
              if key.startswith("timing_s/")}
    tokens, response_tokens = mean("perf/num_tokens"), mean("perf/num_response_tokens")
    per_phase_rate = {"gen": response_tokens / phases["gen"], "update": tokens / phases["update"]}
    for phase in ("old_logprob", "ref"):
        if phase in phases:
            per_phase_rate[phase] = tokens / phases[phase]
    return {
        "steps_measured": len(rows),
        "seconds_per_phase": phases,
        "tokens_per_step": tokens,
        "response_tokens_per_step": response_tokens,
        "tokens_per_s": {k: round(v, 1) for k, v in per_phase_rate.items()},
        "step_tokens_per_s": round(mean("perf/throughput"), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quickstart", type=Path, default=None,
                        help="a finished quickstart run directory: its model, data and SFT policy (default: fresh)")
    parser.add_argument("--work", type=Path, default=None, help="folder for data and the run (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for the GRPO config")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    init = []
    if args.quickstart:
        model_dir, train_file = args.quickstart / "model", args.quickstart / "data" / "train.jsonl"
        init = [f"model.init_from={args.quickstart / 'sft'}"]
    else:
        model_dir, train_file, _ = build_data_and_model(work, QuickstartPlan(num_train=1000, num_heldout=16))
    run_dir = work / "grpo"
    command = [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(ROOT / "configs/quickstart_grpo.yaml"),
               "--nproc", "2", f"model.hf_config={model_dir}", f"data.train_file={train_file}",
               f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}", "trainer.progress_bar=false",
               # a rerun starts afresh, the earlier run moved aside to <run_dir>.old-<time> (the run-folder guard)
               "trainer.resume=none", "trainer.overwrite=true", *init,
               *args.overrides]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if row["step"] > 1 and "timing_s/gen" in row]
    result = {"command": " ".join(command[1:]), **summarise(rows)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
