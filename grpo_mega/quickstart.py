"""``grpo-mega quickstart`` (``make demo``): the whole pipeline on 2 CPU cores, from nothing.

data + tokenizer -> tiny Qwen2-shaped policy -> SFT (TP=2, 2 gloo processes) -> outcome-supervised GRPO (TP=2)
-> held-out evaluation before / after -> a table, a PNG plot and ``summary.json``; the last line printed is the
path of ``summary.json``. Each training stage is a separate ``grpo-mega`` run with a YAML config from configs/.

Half of the SFT targets state the answer without working the steps (``direct_answer_fraction``), as in SFT sets
that mix worked solutions with bare answers: the SFT policy then works the steps on some prompts and guesses on
others, and GRPO, rewarded on the final answer only, learns that working the steps is right more often.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_mega.metrics import read_metrics
from grpo_mega.plots import TRAIN_REWARD_KEY, plot_reward_and_accuracy

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class QuickstartPlan:
    """Sizes of the quickstart; ``fast`` shrinks them for the end-to-end test."""

    num_train: int = 2700
    num_heldout: int = 500
    direct_answer_fraction: float = 0.5
    """Share of SFT targets that state the answer without the steps (see build_synthetic_task)."""
    sft_steps: int | None = None  # None: configs/quickstart_sft.yaml decides
    grpo_steps: int | None = None
    eval_prompts: int | None = None
    eval_every: int | None = None


FAST = QuickstartPlan(num_train=600, num_heldout=32, sft_steps=40, grpo_steps=3, eval_prompts=16, eval_every=0)

# The policy: Qwen2-shaped, tied embeddings, ~0.9M parameters (vocabulary from the trained tokenizer).
POLICY_SHAPE = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0,
)


def build_data_and_model(run_dir: Path, plan: QuickstartPlan, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write the synthetic task, its tokenizer and the policy's HF config folder; returns (model, train, heldout)."""
    from transformers import Qwen2Config

    from grpo_mega.data.build import build_synthetic_task
    from grpo_mega.data.tokenizer import load_tokenizer

    files = build_synthetic_task(run_dir / "data", num_train=plan.num_train, num_heldout=plan.num_heldout, seed=seed,
                                 direct_answer_fraction=plan.direct_answer_fraction)
    tokenizer = load_tokenizer(files.tokenizer)
    model_dir = run_dir / "model"
    config = Qwen2Config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **POLICY_SHAPE,
    )
    config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, files.train, files.heldout


def run_grpo_mega(argv: list[str], log_path: Path) -> float:
    """Run ``grpo-mega <argv>`` as a child process with its output in ``log_path``; returns wall seconds. Raises
    RuntimeError with the log's last lines when it fails."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        code = subprocess.call([sys.executable, "-m", "grpo_mega.cli", *argv], stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"'grpo-mega {' '.join(argv[:2])}' failed (exit {code}); last lines of {log_path}:\n{tail}")
    return time.perf_counter() - start


def _run_stage(command: str, config: str, overrides: list[str], log_path: Path) -> float:
    """Run ``grpo-mega <command>`` on 2 processes with a config of configs/ (see ``run_grpo_mega``)."""
    return run_grpo_mega([command, "--config", str(CONFIG_DIR / config), "--nproc", "2", *overrides], log_path)


def _optional(key: str, value) -> list[str]:
    return [] if value is None else [f"{key}={value}"]


def run_quickstart(run_dir: str | Path = "runs/quickstart", *, fast: bool = False) -> int:
    """Run every stage; print the table and, last, the path of summary.json."""
    plan = FAST if fast else QuickstartPlan()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stage_seconds = {}

    print(f"[1/3] data, tokenizer and model config -> {run_dir}", flush=True)
    begin = time.perf_counter()
    model_dir, train_file, heldout_file = build_data_and_model(run_dir, plan)
    stage_seconds["data"] = time.perf_counter() - begin

    print(f"[2/3] SFT (TP=2 on 2 processes), log: {run_dir / 'sft.log'}", flush=True)
    sft_dir = run_dir / "sft"
    stage_seconds["sft"] = _run_stage(
        "sft", "quickstart_sft.yaml",
        [f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"trainer.run_dir={sft_dir}",
         "trainer.progress_bar=false", *_optional("trainer.total_steps", plan.sft_steps)],
        run_dir / "sft.log",
    )

    print(f"[3/3] GRPO (TP=2 on 2 processes), log: {run_dir / 'grpo.log'}", flush=True)
    grpo_dir = run_dir / "grpo"
    stage_seconds["grpo"] = _run_stage(
        "train", "quickstart_grpo.yaml",
        [f"model.hf_config={model_dir}", f"model.init_from={sft_dir}", f"data.train_file={train_file}",
         f"data.eval_file={heldout_file}", f"trainer.run_dir={grpo_dir}", "trainer.progress_bar=false",
         *_optional("trainer.total_steps", plan.grpo_steps), *_optional("data.max_eval_prompts", plan.eval_prompts),
         *_optional("trainer.eval_every", plan.eval_every)],
        run_dir / "grpo.log",
    )

    rows = read_metrics(grpo_dir / "metrics.jsonl")
    evals = [row for row in rows if "eval/accuracy" in row]
    summary = {
        "accuracy_before": evals[0]["eval/accuracy"],
        "accuracy_after": evals[-1]["eval/accuracy"],
        "steps": rows[-1]["step"],
        "wall_seconds": round(time.perf_counter() - started, 1),
        "stage_seconds": {k: round(v, 1) for k, v in stage_seconds.items()},
        "train_reward_first": next((r[TRAIN_REWARD_KEY] for r in rows if TRAIN_REWARD_KEY in r), None),
        "train_reward_last": next((r[TRAIN_REWARD_KEY] for r in reversed(rows) if TRAIN_REWARD_KEY in r), None),
        "eval_prompts": int(evals[-1]["eval/num_prompts"]),
        "run_dir": str(run_dir),
    }

    summary["plot"] = str(plot_reward_and_accuracy(grpo_dir / "metrics.jsonl", run_dir / "reward_accuracy.png",
                                                   title="quickstart: GRPO on synthetic arithmetic"))
    summary_path = run_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(f"{'':24}{'before GRPO':>14}{'after GRPO':>14}")
    print(f"{'held-out accuracy':24}{summary['accuracy_before']:>14.3f}{summary['accuracy_after']:>14.3f}")
    print(f"GRPO steps: {summary['steps']}   wall time: {summary['wall_seconds']:.0f} s "
          f"(data {stage_seconds['data']:.0f} s, SFT {stage_seconds['sft']:.0f} s, GRPO {stage_seconds['grpo']:.0f} s)")
    print(f"plot: {summary['plot']}")
    print(summary_path)
    return 0

