"""Plots of a run's ``metrics.jsonl`` (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from grpo_mega.metrics import read_metrics


def plot_reward_and_accuracy(metrics_path: str | Path, out_png: str | Path, title: str = "GRPO") -> Path:
    """Training reward (``critic/score/mean``) and held-out accuracy (``eval/accuracy``) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label, style in (("critic/score/mean", "train reward (mean score)", "-"),
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
