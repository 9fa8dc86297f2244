"""Plots of a run's ``metrics.jsonl`` (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from grpo_mega.metrics import read_metrics


TRAIN_REWARD_KEY = "rollout/sampled_score/mean"


def plot_reward_and_accuracy(metrics_path: str | Path, out_png: str | Path, title: str = "GRPO") -> Path:
    """Training reward and held-out accuracy (``eval/accuracy``) against step.

    The reward is the mean score of every sampled completion (``rollout/sampled_score/mean``), which dynamic
    sampling does not bias; metrics files without it fall back to ``critic/score/mean``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4))
    reward_key = TRAIN_REWARD_KEY if any(TRAIN_REWARD_KEY in row for row in rows) else "critic/score/mean"
    for key, label, style in ((reward_key, "train reward (mean score of samples)", "-"),
                              ("eval/accuracy", "held-out accuracy", "o-")):
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            axis.plot(*zip(*points), style, label=label)
    axis.set_xlabel("GRPO step")
    axis.set_ylim(0, 1)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out_png, dpi=120)
    plt.close(figure)
    return Path(out_png)
