"""Issue 79 item 6: ``prm train`` on a file of only correct solutions trained without saying what it read or that
its labels are of one class; rank 0 now says what it trains on and warns of a single class."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from prm.examples import StepExample
from prm.train import label_counts, say_what_was_read


def _cfg(**data):
    defaults = {"labels": "hard", "stop_at_first_bad_step": False, "replay_files": [], "replay_fraction": 0.1,
                "train_file": "labels.jsonl"}
    return SimpleNamespace(data=SimpleNamespace(**{**defaults, **data}))


def test_one_class_labels_are_said(caplog):
    right = [StepExample("1 + 1 =", ["1 + 1 = 2", "The answer is 2."], labels=[True, True]) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="prm.train"):
        say_what_was_read(_cfg(), right, 0, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "training set: 3 rows of labels.jsonl: 6 labelled steps, 100% good",
        "every step label of labels.jsonl is good: the PRM learns one class and scores every step alike; train on "
        "right and wrong steps (grpo-mega prm label labels the policy's own solutions)"]
    assert caplog.records[1].levelno == logging.WARNING


def test_two_classes_are_one_line_and_soft_labels_count_by_half(caplog):
    mixed = [StepExample("q", ["a", "b"], labels=[True, False]),
             StepExample("q", ["a", "b", "c"], labels=[True, True, True], soft_labels=[1.0, 0.25, 0.5])]
    assert label_counts(mixed, "hard", False) == (5, 4)
    assert label_counts(mixed, "soft", False) == (5, 3)
    assert label_counts(mixed, "hard", True) == (5, 4)
    with caplog.at_level(logging.INFO, logger="prm.train"):
        say_what_was_read(_cfg(), mixed, 0, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "training set: 2 rows of labels.jsonl: 5 labelled steps, 80% good"]
