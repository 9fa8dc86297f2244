"""Plots of a run's ``metrics.jsonl`` (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from grpo_mega.run.metrics import read_metrics


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


def plot_arms(metrics_paths: dict[str, str | Path], out_png: str | Path, title: str = "GRPO",
              seconds_before: dict[str, float] | None = None) -> Path:
    """Held-out accuracy (``eval/accuracy``, markers) and training reward (thin line) of several runs from the same
    start (e.g. outcome vs process supervision), one colour per run: against step on the left, against wall-clock
    seconds on the right. A run's seconds are its rows' ``time`` plus ``seconds_before[name]`` (what it cost
    before its first step, e.g. the process arm's PRM labelling and training), so the right panel compares arms at
    equal cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds_before = seconds_before or {}
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for index, (name, path) in enumerate(metrics_paths.items()):
        rows = read_metrics(path)
        colour, offset = f"C{index}", seconds_before.get(name, 0.0)
        for axis, x_of in ((by_step, lambda row: row["step"]), (by_time, lambda row: row["time"] + offset)):
            reward = [(x_of(row), row[TRAIN_REWARD_KEY]) for row in rows if TRAIN_REWARD_KEY in row]
            accuracy = [(x_of(row), row["eval/accuracy"]) for row in rows if "eval/accuracy" in row]
            if reward:
                axis.plot(*zip(*reward), "-", color=colour, alpha=0.35, linewidth=1, label=f"{name}: train reward")
            if accuracy:
                axis.plot(*zip(*accuracy), "o-", color=colour, markersize=4, label=f"{name}: held-out accuracy")
    by_step.set_xlabel("GRPO step")
    by_time.set_xlabel("wall-clock seconds, with what each run cost before its first step")
    by_step.set_ylim(0, 1)
    by_step.set_ylabel("accuracy / mean reward")
    for axis in (by_step, by_time):
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out_png, dpi=120)
    plt.close(figure)
    return Path(out_png)
