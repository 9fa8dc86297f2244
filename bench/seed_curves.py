"""The quickstart arms over seeds at equal seconds, and their mean curves as one plot.

Each arm's ``curve`` in a quickstart summary is ``[[step, seconds, held-out accuracy], ...]``, its seconds counted
from the start of its GRPO command plus, for a learned-PRM arm, what its PRM cost before that (labels, training, the
SFT steps its checkpoint took). At equal seconds two arms are compared at the smaller of their last evaluations'
seconds: each at its latest evaluation within that budget, or at its start accuracy when the budget ended before its
first evaluation (a learned-PRM arm whose PRM took longer than the whole outcome arm has not trained yet). A PRM is
trained once and serves many runs, so the comparison is also made with its one-off cost set aside
(``set_aside``: the arm's ``prm_seconds``). At equal data the arms are compared the same way on the groups their
updates trained on (``groups_curve``: ``[[step, groups trained so far, accuracy], ...]``): process supervision
trains on every group while outcome supervision's dynamic sampling drops the zero-signal ones.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence


def accuracy_at_seconds(curve: Sequence[Sequence[float]], seconds: float) -> float:
    """Held-out accuracy of an arm at ``seconds``: its latest evaluation at or before them, else its start."""
    if not curve:
        raise ValueError("accuracy_at_seconds: the arm has no evaluation")
    reached = [point for point in curve if point[1] <= seconds]
    return (reached[-1] if reached else curve[0])[2]


def _at_equal_budget(curve: Sequence[Sequence[float]], outcome_curve: Sequence[Sequence[float]], unit: str,
                     *, within_a_step: bool = False) -> dict:
    """Two curves whose second column is the budget (seconds, groups, tokens), each at the smaller of their last
    points. ``within_a_step`` (the data budgets): a curve whose last point passes the budget by less than one of
    its own steps (its last budget / its last step) is read at that point, so that two runs of the same steps whose
    data differ by a few tokens are compared at their last evaluations, not one at its previous evaluation (the
    tool task's oracle arm generated 0.01 % more tokens than tool GRPO in 60 steps, and was read at step 30)."""
    budget = min(curve[-1][1], outcome_curve[-1][1])

    def at_budget(points: Sequence[Sequence[float]]) -> float:
        last_step, last_budget, last_accuracy = points[-1]
        if within_a_step and last_step > 0 and last_budget - budget < last_budget / last_step:
            return last_accuracy
        return accuracy_at_seconds(points, budget)

    accuracy, os_accuracy = at_budget(curve), at_budget(outcome_curve)
    return {unit: budget, "accuracy": accuracy, "os_accuracy": os_accuracy, "minus_os": accuracy - os_accuracy}


def equal_seconds(arm: dict, outcome: dict, *, set_aside: float = 0.0) -> dict:
    """``arm`` (a quickstart arm report) against the outcome arm's report at the smaller of their last evaluations'
    seconds, ``set_aside`` seconds taken off the arm's (its PRM's one-off cost): {seconds, accuracy, os_accuracy,
    minus_os}."""
    curve = [[step, seconds - set_aside, accuracy] for step, seconds, accuracy in arm["curve"]]
    return _at_equal_budget(curve, outcome["curve"], "seconds")


def equal_groups(arm: dict, outcome: dict, *, curve: str = "groups_curve") -> dict:
    """``arm`` against the outcome arm at the smaller of the numbers of groups their updates trained on: {groups,
    accuracy, os_accuracy, minus_os}; ``curve="tokens_curve"``: of the tokens their rollouts generated. A run
    within one step of the budget is read at its last evaluation (``_at_equal_budget``'s ``within_a_step``)."""
    return _at_equal_budget(arm[curve], outcome[curve], "groups" if curve == "groups_curve" else "tokens",
                            within_a_step=True)


def mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> list[tuple[float, float, float, float, float]]:
    """(step, mean seconds, mean accuracy, min accuracy, max accuracy) at every step all ``curves`` evaluated."""
    by_step = [{point[0]: point for point in curve} for curve in curves]
    steps = sorted(set.intersection(*(set(points) for points in by_step)))
    rows = []
    for step in steps:
        points = [points[step] for points in by_step]
        accuracies = [point[2] for point in points]
        rows.append((step, statistics.fmean(point[1] for point in points), statistics.fmean(accuracies),
                     min(accuracies), max(accuracies)))
    return rows


def gain_curve(curve: Sequence[Sequence[float]]) -> list[list[float]]:
    """The curve with each accuracy less the first (the start): seeds that start apart read on one scale."""
    return [[step, seconds, accuracy - curve[0][2]] for step, seconds, accuracy in curve]


def line_style(label: str) -> str:
    """A family's line style, so that 15 arms stay apart where colours alone repeat: tree credit dashed, the oracle
    dotted, the implicit PRM dash-dot, the rest (outcome, learned PRM, RFT) solid."""
    if label.startswith("tree"):
        return "--"
    if "oracle" in label:
        return ":"
    if "implicit" in label:
        return "-."
    return "-"


def arm_styles(labels: Sequence[str]) -> list[dict]:
    """matplotlib line settings for each arm: a colour per arm (tab10, or tab20 past 10 arms) and its family's
    ``line_style``."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(labels) <= 10 else "tab20"].colors
    return [dict(color=palette[index % len(palette)], linestyle=line_style(label), marker="o", markersize=3)
            for index, label in enumerate(labels)]


def plot_seed_curves(runs: Sequence[dict], titles: dict[str, str], out_png: Path, title: str) -> Path:
    """Two panels: every arm's mean held-out accuracy gain over its start, over the seeds, against GRPO step (the
    band: the seeds' range) and against mean seconds (PRM cost included); a colour per arm (from 20 where more than
    10 arms), a line style per family (``line_style``), the legend beside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_seconds) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for (arm, label), style in zip(titles.items(), arm_styles(list(titles.values()))):
        rows = mean_curve([gain_curve(run["arms"][arm]["curve"]) for run in runs])
        steps, seconds, means, lows, highs = zip(*rows)
        by_step.plot(steps, means, label=label, **style)
        by_step.fill_between(steps, lows, highs, color=style["color"], alpha=0.08)
        by_seconds.plot(seconds, means, **style)
    by_step.set_xlabel("GRPO step")
    by_seconds.set_xlabel("seconds (mean over seeds; a learned PRM's labels and training first)")
    by_step.set_ylabel(f"held-out accuracy gain (mean of {len(runs)} seeds; band: their range)")
    figure.legend(*by_step.get_legend_handles_labels(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    for axis in (by_step, by_seconds):
        axis.axhline(0.0, color="grey", linewidth=0.8)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=90, bbox_inches="tight")
    plt.close(figure)
    return out_png
