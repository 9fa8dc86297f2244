"""The PRM's side of iterative RL (DeepSeekMath, Algorithm 1): between GRPO iterations the PRM is trained on, the
current policy's solutions get fresh Monte-Carlo labels, and the PRM continues training from its last checkpoint on
those labels plus a replay of a fraction (10 %) of the earlier labels. ``grpo-mega quickstart`` runs it between the
iterations of its process-supervised arm (``QuickstartPlan.iterations``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prm.pipeline import PRMPlan, label_stage, train_stage


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


def replay_mix(new_rows: Sequence[str], history_rows: Sequence[str], fraction: float, seed: int) -> list[str]:
    """The next PRM training set: every new row plus ``round(fraction * len(history_rows))`` earlier rows drawn
    without replacement, shuffled together; deterministic in ``seed``."""
    rng = random.Random(seed)
    replayed = rng.sample(list(history_rows), round(fraction * len(history_rows)))
    mixed = [*new_rows, *replayed]
    rng.shuffle(mixed)
    return mixed


def prompt_window(prompts_file: Path, start: int, count: int, out: Path) -> Path:
    """Rows ``start .. start + count`` of a jsonl prompt file (wrapping around at its end) written to ``out``: each
    refresh labels prompts the earlier ones did not."""
    rows = [line for line in Path(prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{prompts_file}: no prompts to label")
    window = [rows[(start + offset) % len(rows)] for offset in range(min(count, len(rows)))]
    out.write_text("".join(row + "\n" for row in window), encoding="utf-8")
    return out


def refresh_prm(*, model_dir: Path, policy_weights: Path, prompts_file: Path, previous_prm: Path,
                history: Sequence[Path], out_dir: Path, iteration: int, plan: PRMPlan, refresh: RefreshPlan,
                seed: int, show: bool = True) -> tuple[Path, Path, dict[str, float]]:
    """Label ``policy_weights``' solutions to the ``iteration``-th window of ``plan.label_prompts`` prompts, then train
    the PRM on from ``previous_prm`` on them plus a replay of the ``history`` label files. Returns (the new PRM run
    directory, the new label file, seconds per stage)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = prompt_window(prompts_file, iteration * plan.label_prompts, plan.label_prompts,
                            out_dir / f"prompts_iter{iteration}.jsonl")
    labels = out_dir / f"prm_labels_iter{iteration}.jsonl"
    seconds = {"label": label_stage(policy_weights, prompts, labels, plan, seed=seed + iteration,
                                    log=out_dir / f"prm_label_iter{iteration}.log", show=show)}
    history_rows = [row for path in history for row in Path(path).read_text(encoding="utf-8").splitlines() if row]
    new_rows = [row for row in labels.read_text(encoding="utf-8").splitlines() if row]
    mixed = out_dir / f"prm_train_iter{iteration}.jsonl"
    rows = replay_mix(new_rows, history_rows, refresh.replay_fraction, seed + iteration)
    mixed.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    prm_dir = out_dir / f"prm_iter{iteration}"
    seconds["train"] = train_stage(model_dir, previous_prm, mixed, prm_dir, plan, seed=seed + iteration,
                                   steps=refresh.train_steps, log=out_dir / f"prm_train_iter{iteration}.log",
                                   show=show)
    return prm_dir, labels, seconds
