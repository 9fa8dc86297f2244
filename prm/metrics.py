"""PRM evaluation metrics as pure functions on plain lists (no torch).

A step score is the PRM's probability that the step is good; a step is predicted bad when its score is below the
threshold. ``first error`` is the index of the earliest wrong step of a solution, -1 when every step is right.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

AGGREGATIONS = ("min", "last", "product")
DEFAULT_THRESHOLDS = tuple(round(0.05 * k, 2) for k in range(1, 20))
"""0.05, 0.10, ..., 0.95: the grid ``choose_threshold`` searches by default."""


def _check_lengths(first: Sequence[Sequence[Any]], second: Sequence[Sequence[Any]], what: str, names: str) -> None:
    """Same number of examples, and the same number of steps in each; ``names`` = "scores/labels"."""
    name_a, name_b = names.split("/")
    if len(first) != len(second):
        raise ValueError(f"{what}: {len(first)} examples of {name_a} but {len(second)} of {name_b}")
    for index, (row_a, row_b) in enumerate(zip(first, second)):
        if len(row_a) != len(row_b):
            raise ValueError(f"{what}: example {index} has {len(row_a)} {name_a} but {len(row_b)} {name_b}")


def _f1(true_positive: int, false_positive: int, false_negative: int) -> float:
    """2PR / (P + R) = 2TP / (2TP + FP + FN); 0 when there is no positive at all."""
    denominator = 2 * true_positive + false_positive + false_negative
    return 2 * true_positive / denominator if denominator else 0.0


def step_classification(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], threshold: float = 0.5
) -> dict[str, float | int]:
    """Step-level classification of ``score >= threshold`` (good) against the labels, over all steps pooled.

    ``step_f1`` is the F1 of detecting wrong steps (positive class: bad step, predicted bad: score < threshold);
    ``step_f1_good`` takes good steps as the positive class. Counts: ``true_bad`` (bad, predicted bad),
    ``false_bad`` (good, predicted bad), ``missed_bad`` (bad, predicted good), ``true_good``, ``steps``.
    """
    _check_lengths(scores, labels, "step_classification", "scores/labels")
    counts = Counter()
    # (label good, predicted good) -> count name
    outcome = {
        (True, True): "true_good",
        (True, False): "false_bad",
        (False, True): "missed_bad",
        (False, False): "true_bad",
    }
    for row_scores, row_labels in zip(scores, labels):
        for score, good in zip(row_scores, row_labels):
            counts[outcome[bool(good), score >= threshold]] += 1
    steps = sum(counts.values())
    if not steps:
        raise ValueError("step_classification: no steps")
    return {
        "step_accuracy": (counts["true_good"] + counts["true_bad"]) / steps,
        "step_f1": _f1(counts["true_bad"], counts["false_bad"], counts["missed_bad"]),
        "step_f1_good": _f1(counts["true_good"], counts["missed_bad"], counts["false_bad"]),
        "true_bad": counts["true_bad"],
        "false_bad": counts["false_bad"],
        "missed_bad": counts["missed_bad"],
        "true_good": counts["true_good"],
        "steps": steps,
    }


def predicted_first_error(scores: Sequence[float], threshold: float) -> int:
    """Index of the first step scored below ``threshold``, -1 when none is."""
    return next((index for index, score in enumerate(scores) if score < threshold), -1)


def processbench_f1(predicted_first_errors: Sequence[int], true_first_errors: Sequence[int]) -> dict[str, Any]:
    """ProcessBench: ``error_accuracy`` = share of erroneous solutions (true != -1) whose earliest error is found
    exactly, ``correct_accuracy`` = share of correct solutions (true == -1) predicted -1, ``f1`` = their harmonic
    mean (0 when either is 0). An accuracy over no solution is None, and so is ``f1`` then."""
    if len(predicted_first_errors) != len(true_first_errors):
        raise ValueError(
            f"processbench_f1: {len(predicted_first_errors)} predictions for {len(true_first_errors)} solutions"
        )
    erroneous = [p == t for p, t in zip(predicted_first_errors, true_first_errors) if t != -1]
    correct = [p == -1 for p, t in zip(predicted_first_errors, true_first_errors) if t == -1]
    error_accuracy = sum(erroneous) / len(erroneous) if erroneous else None
    correct_accuracy = sum(correct) / len(correct) if correct else None
    if error_accuracy is None or correct_accuracy is None:
        f1 = None
    elif error_accuracy == 0 or correct_accuracy == 0:
        f1 = 0.0
    else:
        f1 = 2 * error_accuracy * correct_accuracy / (error_accuracy + correct_accuracy)
    return {
        "error_accuracy": error_accuracy,
        "correct_accuracy": correct_accuracy,
        "f1": f1,
        "erroneous": len(erroneous),
        "correct": len(correct),
    }


def choose_threshold(
    dev_scores: Sequence[Sequence[float]], dev_first_errors: Sequence[int], candidates: Sequence[float] | None = None
) -> tuple[float, float]:
    """The candidate threshold with the best ProcessBench F1 on a dev split, and that F1.

    Ties go to the candidate closest to 0.5 (then the smaller). A dev split with only erroneous or only correct
    solutions has no F1; the accuracy on the solutions it has is maximised instead (and returned).
    """
    candidates = DEFAULT_THRESHOLDS if candidates is None else tuple(candidates)
    if not candidates:
        raise ValueError("choose_threshold: no candidate thresholds")
    if not dev_first_errors:
        raise ValueError("choose_threshold: empty dev split")
    best: tuple[float, float, float] | None = None  # (value, -distance to 0.5, -threshold): larger is better
    chosen = candidates[0]
    for threshold in candidates:
        result = processbench_f1([predicted_first_error(s, threshold) for s in dev_scores], dev_first_errors)
        value = result["f1"]
        if value is None:
            value = result["error_accuracy"] if result["correct_accuracy"] is None else result["correct_accuracy"]
        key = (value, -abs(threshold - 0.5), -threshold)
        if best is None or key > best:
            best, chosen = key, threshold
    return chosen, best[0]


def aggregate_steps(scores: Sequence[float], how: str) -> float:
    """One solution score from its step scores: ``min``, ``last`` or ``product``."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregate_steps: unknown aggregation {how!r}; expected one of {AGGREGATIONS}")
    if not scores:
        raise ValueError("aggregate_steps: no step scores")
    if how == "min":
        return min(scores)
    if how == "last":
        return scores[-1]
    product = 1.0
    for score in scores:
        product *= score
    return product


def _get(candidate: Any, name: str) -> Any:
    return candidate[name] if isinstance(candidate, Mapping) else getattr(candidate, name)


def best_of_n(groups: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Best-of-N over problems; each group holds one problem's candidates, each with ``answer`` (str or None),
    ``correct`` (bool) and ``step_scores`` (a dict or an object with those attributes).

    - ``prm_at_n_{how}``: share of problems whose candidate with the highest ``aggregate_steps(step_scores, how)``
      (the first on ties) is correct; ``prm_at_n`` is ``prm_at_n_min``.
    - ``maj_at_n``: share of problems whose most frequent non-None answer (ties: the first seen) belongs to correct
      candidates (all candidates giving it are correct); a problem with no answer at all counts as wrong.
    - ``pass_at_n``: share of problems with at least one correct candidate.
    - ``n``: candidates per problem (their mean when the groups differ in size); ``problems``.
    """
    if not groups:
        raise ValueError("best_of_n: no problems")
    wins = Counter()
    for index, group in enumerate(groups):
        if not group:
            raise ValueError(f"best_of_n: problem {index} has no candidates")
        for how in AGGREGATIONS:
            try:
                values = [aggregate_steps(_get(c, "step_scores"), how) for c in group]
            except ValueError as error:
                raise ValueError(f"best_of_n: problem {index}: {error}") from None
            wins[how] += bool(_get(group[values.index(max(values))], "correct"))
        votes = Counter(_get(c, "answer") for c in group if _get(c, "answer") is not None)
        if votes:
            top = max(votes.values())
            voted = next(_get(c, "answer") for c in group if votes.get(_get(c, "answer")) == top)
            wins["maj"] += all(bool(_get(c, "correct")) for c in group if _get(c, "answer") == voted)
        wins["pass"] += any(bool(_get(c, "correct")) for c in group)
    sizes = [len(group) for group in groups]
    report = {f"prm_at_n_{how}": wins[how] / len(groups) for how in AGGREGATIONS}
    report.update(
        prm_at_n=report["prm_at_n_min"],
        maj_at_n=wins["maj"] / len(groups),
        pass_at_n=wins["pass"] / len(groups),
        n=sizes[0] if len(set(sizes)) == 1 else sum(sizes) / len(sizes),
        problems=len(groups),
    )
    return report


def label_agreement(predicted: Sequence[Sequence[bool]], truth: Sequence[Sequence[bool]]) -> float:
    """Fraction of steps, pooled over examples, whose predicted label equals the true one."""
    _check_lengths(predicted, truth, "label_agreement", "predicted labels/true labels")
    pairs = [(p, t) for row_p, row_t in zip(predicted, truth) for p, t in zip(row_p, row_t)]
    if not pairs:
        raise ValueError("label_agreement: no steps")
    return sum(bool(p) == bool(t) for p, t in pairs) / len(pairs)


def auroc(scores: Sequence[float], truth: Sequence[bool]) -> float | None:
    """P(score of a true step > score of a false one), ties counted half (the Mann-Whitney U over the product of
    the two classes' sizes); None without both classes."""
    if len(scores) != len(truth):
        raise ValueError(f"auroc: {len(scores)} scores for {len(truth)} labels")
    ranked = sorted(zip(scores, (bool(t) for t in truth)))
    positives = sum(t for _, t in ranked)
    negatives = len(ranked) - positives
    if not positives or not negatives:
        return None
    rank_sum, index = 0.0, 0
    while index < len(ranked):
        tied = index
        while tied < len(ranked) and ranked[tied][0] == ranked[index][0]:
            tied += 1
        average_rank = (index + tied + 1) / 2  # 1-based ranks index+1 .. tied
        rank_sum += average_rank * sum(1 for _, t in ranked[index:tied] if t)
        index = tied
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)
