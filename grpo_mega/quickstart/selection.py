"""Which SFT checkpoint the quickstart's GRPO arms start from, when the plan picks it by measured pass@1
(``QuickstartPlan.policy_max_pass_at_1``) instead of by step number.

A fixed step does not make a regime reliably sparse: the tiny policy's pass@1 crosses a cliff whose place moves with
the seed (sampled pass@1 at SFT step 500 of three seeds: 13.5 %, 56 %, 14.8 %). So SFT keeps a checkpoint every
``policy_sft_step`` steps, and ``grpo-mega eval`` measures each one's sampled pass@1 (temperature 1, the rollouts'
temperature) on prompts of the TRAINING file, the prompts GRPO will sample groups from: how often a group's
completions are right is what decides how sparse the outcome reward is, and no held-out prompt takes part in the
choice. The checkpoints are measured in step order until one is above the ceiling; the arms start from the measured
one whose pass@1 is closest to the ceiling (issue 47: seeds that start 8 - 32 % apart answer different questions;
a finer interval and the closest checkpoint bring their starts together), decided before any GRPO step runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from grpo_mega.run.commands import CONFIG_DIR, CommandProgress, run_command


def pick_closest_to_ceiling(steps: list[int], measure: Callable[[int], float],
                            ceiling: float) -> tuple[int, dict[int, float]]:
    """(the chosen step, the pass@1 measured per step): ``steps`` in increasing order are measured until one is
    above ``ceiling``; of those measured, the one whose pass@1 is closest to ``ceiling`` is chosen (on a tie the one
    at or under it, then the later)."""
    if not steps or sorted(steps) != list(steps) or len(set(steps)) != len(steps):
        raise ValueError(f"pick_closest_to_ceiling: steps must be increasing and non-empty, got {steps}")
    if not 0.0 <= ceiling <= 1.0:
        raise ValueError(f"pick_closest_to_ceiling: the pass@1 ceiling must be in [0, 1], got {ceiling}")
    measured: dict[int, float] = {}
    for step in steps:
        measured[step] = measure(step)
        if measured[step] > ceiling:
            break
    chosen = min(measured, key=lambda step: (abs(measured[step] - ceiling), measured[step] > ceiling, -step))
    return chosen, measured


def measure_pass_at_1(checkpoint: Path, *, task: list[str], prompts_file: Path, prompts: int, samples: int,
                      response_length: int | None, out: Path, nproc: int) -> float:
    """Sampled pass@1 of ``checkpoint`` (mean over ``samples`` evaluations at temperature 1) on the first
    ``prompts`` prompts of ``prompts_file``, by ``grpo-mega eval`` under configs/quickstart_grpo.yaml; the report is
    written to ``out`` and its command's log beside it."""
    argv = ["eval", "--config", str(CONFIG_DIR / "quickstart_grpo.yaml"), "--policy", str(checkpoint),
            "--samples", str(samples), "--out", str(out), "--nproc", str(nproc), *task,
            f"data.eval_file={prompts_file}", f"data.max_eval_prompts={prompts}", "trainer.eval_temperature=1.0",
            *([f"algorithm.response_length={response_length}"] if response_length is not None else [])]
    run_command(argv, out.with_suffix(".log"), CommandProgress(title=f"pass@1 of {checkpoint.name}"))
    return float(json.loads(out.read_text())["accuracy_mean"])
