"""The PRM's side of iterative RL (DeepSeekMath, Algorithm 1): between GRPO iterations the PRM is trained on, the
current policy's solutions get fresh Monte-Carlo labels, and the PRM continues training from its last checkpoint on
those labels plus a replay of a fraction (10 %) of the earlier labels. ``grpo-mega quickstart`` runs it between the
iterations of its process-supervised arm (``QuickstartPlan.iterations``). The replay is ``grpo-mega prm train``'s own
``data.replay_files`` / ``data.replay_fraction`` (``prm.train.training_examples``), the options a cluster user passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prm.pipeline import PRMPlan, run_label_command, run_train_command


@dataclass(frozen=True)
class RefreshPlan:
    """Sizes of one PRM refresh."""

    train_steps: int = 100
    """PRM training steps per refresh, continuing from the previous PRM (its optimizer state starts afresh)."""
    replay_fraction: float = 0.1
    """Share of the earlier label rows mixed into each refresh's training set (DeepSeekMath: 10 %)."""

    def __post_init__(self) -> None:
        if self.train_steps < 1:
            raise ValueError(f"RefreshPlan.train_steps must be >= 1, got {self.train_steps}")
        if not 0.0 <= self.replay_fraction <= 1.0:
            raise ValueError(f"RefreshPlan.replay_fraction must be in [0, 1], got {self.replay_fraction}")


def prompt_window(prompts_file: Path, start: int, count: int, out: Path) -> Path:
    """Rows ``start .. start + count`` of a jsonl prompt file (wrapping around at its end) written to ``out``: each
    refresh labels prompts the earlier ones did not."""
    rows = [line for line in Path(prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{prompts_file}: no prompts to label")
    window = [rows[(start + offset) % len(rows)] for offset in range(min(count, len(rows)))]
    out.write_text("".join(row + "\n" for row in window), encoding="utf-8")
    return out


def replay_overrides(history: Sequence[Path], fraction: float) -> list[str]:
    """The ``grpo-mega prm train`` overrides that replay ``fraction`` of the rows of the ``history`` label files
    (``data.replay_files``, ``data.replay_fraction``; the list as JSON, which the override parser reads as YAML, so
    paths with spaces or commas survive)."""
    return [f"data.replay_files={json.dumps([str(path) for path in history])}", f"data.replay_fraction={fraction}"]


def refresh_prm(*, model_dir: Path, policy_weights: Path, prompts_file: Path, previous_prm: Path,
                history: Sequence[Path], out_dir: Path, iteration: int, plan: PRMPlan, refresh: RefreshPlan,
                seed: int, show: bool = True) -> tuple[Path, Path, dict[str, float]]:
    """Label ``policy_weights``' solutions to the ``iteration``-th window of ``plan.label_prompts`` prompts, then train
    the PRM on from ``previous_prm`` on them plus a replay of the ``history`` label files. Returns (the new PRM run
    directory, the new label file, seconds per command)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = prompt_window(prompts_file, iteration * plan.label_prompts, plan.label_prompts,
                            out_dir / f"prompts_iter{iteration}.jsonl")
    labels = out_dir / f"prm_labels_iter{iteration}.jsonl"
    seconds = {"label": run_label_command(policy_weights, prompts, labels, plan, seed=seed + iteration,
                                          log=out_dir / f"prm_label_iter{iteration}.log", show=show)}
    prm_dir = out_dir / f"prm_iter{iteration}"
    seconds["train"] = run_train_command(model_dir, previous_prm, labels, prm_dir, plan, seed=seed + iteration,
                                         steps=refresh.train_steps, log=out_dir / f"prm_train_iter{iteration}.log",
                                         show=show, overrides=replay_overrides(history, refresh.replay_fraction))
    return prm_dir, labels, seconds
