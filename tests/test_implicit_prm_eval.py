"""The implicit PRM's held-out figures (``grpo_mega.stages.implicit_prm_eval``) on hand-computed cases: step scores
from token rewards over the pieces process supervision scores, the wrong-step predictions, ProcessBench F1 and the
step-level F1 against the synthetic task's step checker."""

import math

import pytest
import torch

from grpo_mega.data.step_split import SYNTHETIC_STEP_PATTERN
from grpo_mega.data.synthetic import Problem, Step
from grpo_mega.stages.implicit_prm_eval import (
    outcome_figures,
    piece_scores,
    scored_pieces,
    step_detection,
    synthetic_truth,
)

PROBLEM = Problem(start=7, steps=(Step(7, "+", 5, 12), Step(12, "*", 3, 36)))
EXTRA = {"steps": [{"lhs": s.lhs, "op": s.op, "rhs": s.rhs, "result": s.result} for s in PROBLEM.steps]}


def char_decode(ids):
    """A tokenizer of one character per id (id = code point)."""
    return "".join(chr(i) for i in ids)


def test_pieces_stop_at_the_answer_and_take_the_step_checker_truth():
    text = " Step 1: 7 + 5 = 13. Step 2: 13 * 3 = 39. The answer is 39. Step 3: junk"
    answer_end = text.index("39.", text.index("The answer")) + 2
    pieces = scored_pieces(text, answer_end, SYNTHETIC_STEP_PATTERN, 0)
    assert "".join(pieces) == text[:answer_end] and len(pieces) == 3
    # step 1 is wrong arithmetic, step 2 right on the carried value but not the problem's, the answer wrong
    assert synthetic_truth(EXTRA, pieces) == [False, False, False]
    right = scored_pieces(PROBLEM.solution, None, SYNTHETIC_STEP_PATTERN, 0)
    assert synthetic_truth(EXTRA, right) == [True, True, True]
    assert synthetic_truth(EXTRA, []) == []


def test_piece_scores_are_their_tokens_reward_sums_or_the_q_value_probability():
    pieces = ["ab", "cde", "f"]
    ids = [ord(c) for c in "abcdef"]
    rewards = torch.tensor([0.1, 0.2, -0.5, 0.0, 0.25, 1.0])
    assert piece_scores(rewards, pieces, ids, char_decode, "sum") == pytest.approx([0.3, -0.25, 1.0])
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert piece_scores(rewards, pieces, ids, char_decode, "probability") == pytest.approx(
        [sigmoid(0.3), sigmoid(0.05), sigmoid(1.05)])


def test_a_piece_ending_in_the_token_before_it_gets_no_reward_of_its_own():
    # two ids decode to "ab" and "cd"; the pieces "abc" and "d" both end in the second token
    decode = lambda ids: "".join({1: "ab", 2: "cd"}[i] for i in ids)  # noqa: E731
    assert piece_scores(torch.tensor([0.5, -0.25]), ["abc", "d"], [1, 2], decode, "sum") == pytest.approx([0.25, 0.0])


def test_step_detection_finds_first_errors_as_processbench_counts_them():
    truths = [[True, False, True], [True, True], [True, False], []]
    scores = [[0.1, -0.2, 0.3],  # first error found at 1: right
              [0.5, 0.1],  # no error predicted on a right solution: right
              [-0.1, -0.4],  # error predicted at 0, true 1: wrong
              [-9.0]]  # no truth (no pieces): not counted
    figures = step_detection(scores, truths, "sum")
    assert figures["eval/implicit_prm/processbench_error_accuracy"] == pytest.approx(0.5)
    assert figures["eval/implicit_prm/processbench_correct_accuracy"] == pytest.approx(1.0)
    assert figures["eval/implicit_prm/processbench_f1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    # wrong steps: 2, both predicted wrong; one right step predicted wrong -> F1 = 2*2 / (2*2 + 1 + 0)
    assert figures["eval/implicit_prm/step_f1"] == pytest.approx(0.8)
    assert figures["eval/implicit_prm/step_accuracy"] == pytest.approx(6 / 7)
    # probabilities: wrong below 0.5
    assert step_detection([[0.7, 0.4]], [[True, False]], "probability")[
        "eval/implicit_prm/processbench_error_accuracy"] == 1.0


def test_figures_without_a_defined_value_are_left_out():
    # only right solutions: ProcessBench's error accuracy (and so its F1) is undefined
    figures = step_detection([[0.2, 0.1]], [[True, True]], "sum")
    assert "eval/implicit_prm/processbench_f1" not in figures
    assert figures["eval/implicit_prm/processbench_correct_accuracy"] == 1.0
    assert step_detection([[1.0]], [[]], "sum") == {}


def test_the_outcome_is_predicted_by_the_sign_of_the_summed_reward():
    rewards = torch.tensor([[0.5, -0.1], [-0.3, 0.1], [0.0, 0.0]])
    assert outcome_figures(rewards, [1.0, 1.0, 0.0]) == {"eval/implicit_prm/outcome_accuracy": pytest.approx(2 / 3)}


def test_a_dev_share_picks_the_threshold_a_weak_prms_scale_needs():
    """Every step sum above 0 (a sign test finds no error), but the first wrong step always scored lowest: the
    fixed threshold's F1 is 0, the dev-picked one finds every first error and clears every right solution."""
    right, wrong = ([0.3, 0.25, 0.3], [True, True, True]), ([0.3, 0.1, 0.2], [True, False, False])
    rows = [right, wrong] * 10
    figures = step_detection([s for s, _ in rows], [t for _, t in rows], "sum", seed=3)
    assert figures["eval/implicit_prm/processbench_f1"] == 0.0
    assert figures["eval/implicit_prm/tuned_processbench_f1"] == 1.0
    assert 0.1 < figures["eval/implicit_prm/tuned_processbench_threshold"] <= 0.25
