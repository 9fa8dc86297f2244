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


def plot_arms(metrics_paths: dict[str, str | Path], out_png: str | Path, title: str = "GRPO") -> Path:
    """Held-out accuracy (``eval/accuracy``, markers) and training reward (thin line) against step for several
    runs from the same start (e.g. outcome vs process supervision), one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for index, (name, path) in enumerate(metrics_paths.items()):
        rows = read_metrics(path)
        colour = f"C{index}"
        reward = [(row["step"], row[TRAIN_REWARD_KEY]) for row in rows if TRAIN_REWARD_KEY in row]
        accuracy = [(row["step"], row["eval/accuracy"]) for row in rows if "eval/accuracy" in row]
        if reward:
            axis.plot(*zip(*reward), "-", color=colour, alpha=0.35, linewidth=1, label=f"{name}: train reward")
        if accuracy:
            axis.plot(*zip(*accuracy), "o-", color=colour, label=f"{name}: held-out accuracy")
    axis.set_xlabel("GRPO step")
    axis.set_ylim(0, 1)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_png, dpi=120)
    plt.close(figure)
    return Path(out_png)
