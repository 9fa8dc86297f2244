"""How good a PRM is, on step-labelled data (here) and on reranking a policy's samples (``prm.best_of_n``): the
figures of ``grpo-mega prm eval`` (``prm.eval_command``).

- Step classification (rows with step labels): ``step_accuracy``, ``step_f1`` (wrong steps as the positive class)
  at the threshold 0.5.
- ProcessBench-style F1 (rows whose earliest wrong step is known, or derivable from their labels): the predicted
  earliest error is the first step scored below a threshold; the threshold is chosen on a dev split (``--dev-file``,
  else a seeded ``--dev-fraction`` of the rows) and reported; F1 is the harmonic mean of the accuracy on erroneous
  and on correct solutions of the other rows.
- ``step_auroc``: how well the scores rank the steps labelled good above the bad ones (AUROC, no threshold).
- ``label_agreement``: when rows carry both Monte-Carlo labels and the ground truth (``extra["true_labels"]``: the
  synthetic task's step checker, or a turn checker's verdicts, ``prm label --turn-truth``), the fraction of steps
  where they agree; ``true_step_auroc``: the AUROC of the scores against that truth.
- Best-of-N (``--policy``, ``--prompts``): N policy samples per prompt, scored by the PRM; ``prm_at_n`` (the best
  aggregated score picks the answer; min / last / product), ``maj_at_n`` (majority vote) and ``pass_at_n``.
"""

from __future__ import annotations

import random
from typing import Sequence

from prm.examples import StepExample, first_error_of
from prm.metrics import (
    auroc,
    choose_threshold,
    label_agreement,
    predicted_first_error,
    processbench_f1,
    step_classification,
)

REPORT_KEYS = ("step_accuracy", "step_f1", "processbench_f1", "prm_at_n", "maj_at_n", "pass_at_n", "label_agreement")


def known_first_error(example: StepExample) -> int | None:
    """The example's earliest wrong step: given (ProcessBench), derived from hard labels, else None."""
    if example.first_error is not None:
        return example.first_error
    if example.labels is not None:
        return first_error_of(example.labels)
    return None


def step_report(examples: Sequence[StepExample], scores: Sequence[Sequence[float]]) -> dict:
    """Step accuracy and F1 at 0.5 over the examples that have hard labels ({} when none has)."""
    labelled = [(s, e.labels) for e, s in zip(examples, scores) if e.labels is not None and e.steps]
    if not labelled:
        return {}
    report = step_classification([s for s, _ in labelled], [labels for _, labels in labelled])
    return {key: report[key] for key in ("step_accuracy", "step_f1", "step_f1_good")} | {
        "labelled_steps": sum(len(labels) for _, labels in labelled),
        "step_auroc": auroc([v for s, _ in labelled for v in s], [t for _, labels in labelled for t in labels])}


def split_dev(count: int, dev_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of a seeded dev split (at least one row when ``dev_fraction`` > 0) and the rest."""
    if not 0 <= dev_fraction < 1:
        raise ValueError(f"--dev-fraction must be in [0, 1), got {dev_fraction}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    dev_count = max(1, round(count * dev_fraction)) if dev_fraction > 0 and count > 1 else 0
    return sorted(order[:dev_count]), sorted(order[dev_count:])


def processbench_report(
    scores: Sequence[Sequence[float]],
    first_errors: Sequence[int],
    dev_scores: Sequence[Sequence[float]],
    dev_first_errors: Sequence[int],
) -> dict:
    """ProcessBench F1 of ``scores`` at the threshold that maximises it on the dev rows (0.5 without dev rows)."""
    if dev_scores:
        threshold, dev_f1 = choose_threshold(list(dev_scores), list(dev_first_errors))
    else:
        threshold, dev_f1 = 0.5, None
    predicted = [predicted_first_error(s, threshold) for s in scores]
    result = processbench_f1(predicted, list(first_errors))
    return {
        "processbench_f1": result["f1"],
        "processbench_error_accuracy": result["error_accuracy"],
        "processbench_correct_accuracy": result["correct_accuracy"],
        "processbench_threshold": threshold,
        "processbench_dev_f1": dev_f1,
        "processbench_rows": len(first_errors),
        "processbench_erroneous_rows": sum(1 for e in first_errors if e >= 0),
        "processbench_dev_rows": len(dev_first_errors),
    }


def data_report(
    examples: Sequence[StepExample],
    scores: Sequence[Sequence[float]],
    *,
    dev_examples: Sequence[StepExample] = (),
    dev_scores: Sequence[Sequence[float]] = (),
    dev_fraction: float = 0.3,
    seed: int = 0,
) -> dict:
    """Step classification, ProcessBench F1 and label agreement of scored examples (see the module docstring)."""
    report: dict = {"examples": len(examples)}
    report.update(step_report(examples, scores))
    rows = [(s, known_first_error(e)) for e, s in zip(examples, scores) if e.steps and known_first_error(e) is not None]
    if rows:
        if dev_examples:
            dev_rows = [(s, known_first_error(e)) for e, s in zip(dev_examples, dev_scores)
                        if e.steps and known_first_error(e) is not None]
            test_rows = rows
        else:
            dev_index, test_index = split_dev(len(rows), dev_fraction, seed)
            dev_rows, test_rows = [rows[i] for i in dev_index], [rows[i] for i in test_index]
        report.update(processbench_report([s for s, _ in test_rows], [e for _, e in test_rows],
                                          [s for s, _ in dev_rows], [e for _, e in dev_rows]))
    with_truth = [e for e in examples if e.labels is not None and "true_labels" in e.extra]
    if with_truth:
        report["label_agreement"] = label_agreement([e.labels for e in with_truth],
                                                    [list(e.extra["true_labels"]) for e in with_truth])
    scored_truth = [(s, e.extra["true_labels"]) for e, s in zip(examples, scores)
                    if e.steps and e.extra.get("true_labels") is not None]
    if scored_truth:
        report["true_step_auroc"] = auroc([v for s, _ in scored_truth for v in s],
                                          [bool(t) for _, truth in scored_truth for t in truth])
    return report


def finish_report(report: dict) -> dict:
    """The report with every key of ``REPORT_KEYS`` present (null when it does not apply)."""
    return {key: report.get(key) for key in REPORT_KEYS} | report
