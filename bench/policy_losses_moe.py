"""Each policy loss (``algorithm.policy_loss``) training a tiny Qwen3-MoE without routing replay (issue 78).

The end-to-end tests' tiny task with a random Qwen3-MoE policy (8 experts of width 64, top-2, 4 layers; experts over
2 ranks: ``parallel.expert=2``), ``rollout.routing_replay`` off, trained with ``grpo-mega train --nproc 2`` for
``--steps`` steps of 8 prompts x 4 completions in 4 mini-batches (4 optimizer steps per GRPO step, so the policy
moves within a step and the forms differ). A random policy never solves the task's arithmetic, so the reward is one it
can learn from scratch: the share of a completion's characters that are digits (``digit_share``). Per form and seed:
whether every logged figure stayed finite, the mean training score of the first and last 3 steps, the mean
``actor/pg_clipfrac`` and the largest ``|actor/ppo_kl|``. Writes ``bench/results/policy_losses_moe.json``.

    .venv/bin/python bench/policy_losses_moe.py [--seeds 1 2 3] [--steps 12] [--forms ppo gspo ...]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FORMS = ("ppo", "gspo", "gspo_token", "gmpo", "cispo")
SEQUENCE_MEAN = {"gspo", "gspo_token", "gmpo"}


def digit_share(prompt: str, completion: str, answer: str, **row) -> float:
    """The share of the completion's characters that are digits: a reward a random policy can learn."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def train(form: str, seed: int, steps: int, model_dir: Path, train_file: Path, run_dir: Path) -> list[dict]:
    from grpo_mega.run.metrics import read_metrics

    overrides = [
        f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}", f"parallel.seed={seed}", f"algorithm.policy_loss={form}",
        f"reward.function={Path(__file__).resolve()}:digit_share", "algorithm.rollout_batch_size=8",
        "algorithm.num_return_sequences_in_group=4", "algorithm.mini_batch_size=2", "algorithm.response_length=12",
        "algorithm.dynamic_sampling=false", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "trainer.eval_every=0", "parallel.device=cpu", "rollout.engine=hf", "rollout.routing_replay=false",
        "parallel.tensor=1", "parallel.expert=2", "optim.lr=1e-3",
    ]
    if form in SEQUENCE_MEAN:
        overrides.append("algorithm.loss_agg_mode=seq-mean-token-mean")
    command = [sys.executable, "-m", "grpo_mega.cli", "train", "--config", "configs/quickstart_grpo.yaml",
               "--nproc", "2", *overrides]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{form} seed {seed}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return read_metrics(run_dir / "metrics.jsonl")


def summarise(rows: list[dict]) -> dict:
    scores = [row["critic/score/mean"] for row in rows]
    return {
        "finite": all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float)),
        "score_first3": statistics.mean(scores[:3]), "score_last3": statistics.mean(scores[-3:]),
        "pg_clipfrac_mean": statistics.mean(row["actor/pg_clipfrac"] for row in rows),
        "ppo_kl_abs_max": max(abs(row["actor/ppo_kl"]) for row in rows),
        "optimizer_steps_per_step": rows[0]["actor/optimizer_steps"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "policy_losses_moe.json")
    args = parser.parse_args()
    from tiny_task import build_tiny_qwen3_task

    started = time.perf_counter()
    runs: dict[str, dict[int, dict]] = {form: {} for form in args.forms}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, train_file = build_tiny_qwen3_task(Path(tmp) / "task", moe=True)
        for seed in args.seeds:
            for form in args.forms:
                rows = train(form, seed, args.steps, model_dir, train_file, Path(tmp) / f"{form}_{seed}")
                runs[form][seed] = summarise(rows)
                print(f"{form:10s} seed {seed}: {runs[form][seed]}", flush=True)
    means = {form: {key: statistics.mean(float(run[key]) for run in per_seed.values())
                    for key in ("score_first3", "score_last3", "pg_clipfrac_mean", "ppo_kl_abs_max")}
             | {"all_finite": all(run["finite"] for run in per_seed.values())}
             for form, per_seed in runs.items()}
    for form, mean in means.items():
        print(f"{form:10s} score {mean['score_first3']:.3f} -> {mean['score_last3']:.3f}, clipped tokens "
              f"{mean['pg_clipfrac_mean']:.4f}, finite {mean['all_finite']}")
    result = {"command": "bench/policy_losses_moe.py " + " ".join(sys.argv[1:]), "machine": platform.node(),
              "processor": platform.processor(), "seconds": round(time.perf_counter() - started, 1),
              "mean_over_seeds": means, "runs": runs}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
