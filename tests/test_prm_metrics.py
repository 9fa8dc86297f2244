"""PRM metrics on hand-worked cases: step classification, first-error prediction, ProcessBench F1, threshold choice,
step aggregation, best-of-N, label agreement and AUROC."""

from dataclasses import dataclass

import pytest

from prm.metrics import (
    DEFAULT_THRESHOLDS,
    aggregate_steps,
    auroc,
    best_of_n,
    choose_threshold,
    label_agreement,
    predicted_first_error,
    processbench_f1,
    step_classification,
)

SCORES = [[0.9, 0.4, 0.2], [0.6, 0.7]]
LABELS = [[True, True, False], [True, False]]


def test_step_classification_hand_worked():
    # Steps at 0.5: good/0.9 right, good/0.4 predicted bad, bad/0.2 caught, good/0.6 right, bad/0.7 missed.
    result = step_classification(SCORES, LABELS)
    assert (result["true_good"], result["false_bad"], result["true_bad"], result["missed_bad"]) == (2, 1, 1, 1)
    assert result["steps"] == 5
    assert result["step_accuracy"] == pytest.approx(3 / 5)
    assert result["step_f1"] == pytest.approx(0.5)  # bad steps: precision 1/2, recall 1/2
    assert result["step_f1_good"] == pytest.approx(2 / 3)  # good steps: precision 2/3, recall 2/3
    # At 0.3 the 0.4 step counts as good: bad-step precision 1/1, recall 1/2.
    lower = step_classification(SCORES, LABELS, threshold=0.3)
    assert lower["step_accuracy"] == pytest.approx(4 / 5)
    assert lower["step_f1"] == pytest.approx(2 / 3)
    # A score equal to the threshold is good.
    assert step_classification([[0.5]], [[True]])["step_accuracy"] == 1.0


def test_step_f1_is_zero_without_any_bad_step_or_bad_prediction():
    result = step_classification([[0.9, 0.8]], [[True, True]])
    assert result["step_f1"] == 0.0 and result["step_f1_good"] == 1.0 and result["step_accuracy"] == 1.0


def test_step_classification_length_mismatch_names_the_example():
    with pytest.raises(ValueError, match="example 1 has 2 scores but 3 labels"):
        step_classification(SCORES, [[True, True, False], [True, False, True]])
    with pytest.raises(ValueError, match="2 examples of scores but 1 of labels"):
        step_classification(SCORES, LABELS[:1])
    with pytest.raises(ValueError, match="no steps"):
        step_classification([[]], [[]])


def test_predicted_first_error():
    assert predicted_first_error([0.9, 0.4, 0.2], 0.5) == 1
    assert predicted_first_error([0.9, 0.4, 0.2], 0.1) == -1
    assert predicted_first_error([0.9, 0.5], 0.5) == -1  # not strictly below
    assert predicted_first_error([], 0.5) == -1


def test_processbench_f1_on_four_solutions():
    # Erroneous: (true 2, predicted 2) right, (true 0, predicted 1) wrong -> 1/2.
    # Correct: predicted -1 right, predicted 1 wrong -> 1/2.
    result = processbench_f1([-1, 1, 2, 1], [-1, -1, 2, 0])
    assert result["error_accuracy"] == 0.5 and result["correct_accuracy"] == 0.5
    assert result["f1"] == pytest.approx(0.5)
    assert (result["erroneous"], result["correct"]) == (2, 2)
    result = processbench_f1([-1, -1, 2, 1], [-1, -1, 2, 0])
    assert result["f1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert processbench_f1([3, -1, 2, 1], [-1, -1, 2, 0])["f1"] == pytest.approx(0.5)
    assert processbench_f1([-1, -1, -1, -1], [-1, -1, 2, 0])["f1"] == 0.0  # no error found at all
    only_errors = processbench_f1([2, 1], [2, 0])
    assert only_errors["error_accuracy"] == 0.5
    assert only_errors["correct_accuracy"] is None and only_errors["f1"] is None
    with pytest.raises(ValueError, match="3 predictions for 4 solutions"):
        processbench_f1([-1, 1, 2], [-1, -1, 2, 0])


DEV_SCORES = [[0.9, 0.8, 0.7], [0.9, 0.35, 0.2], [0.6, 0.45, 0.9], [0.3, 0.1]]
DEV_FIRST_ERRORS = [-1, 1, -1, 0]


def test_choose_threshold_on_a_tiny_dev_set():
    # Right on all four only for 0.35 < t <= 0.45 (0.40 and 0.45 on the grid); 0.45 is nearer to 0.5.
    # At 0.5 the third solution is flagged (0.45 < 0.5): F1 2/3; at 0.35 the second is found late: F1 2/3.
    assert choose_threshold(DEV_SCORES, DEV_FIRST_ERRORS) == (0.45, 1.0)
    assert choose_threshold(DEV_SCORES, DEV_FIRST_ERRORS, candidates=[0.35, 0.5, 0.4]) == (0.4, 1.0)
    threshold, f1 = choose_threshold(DEV_SCORES, DEV_FIRST_ERRORS, candidates=[0.3, 0.5, 0.8])
    # 0.3 finds no error where it is (F1 0); 0.8 flags both correct solutions (F1 0).
    assert (threshold, f1) == (0.5, pytest.approx(2 / 3))
    assert DEFAULT_THRESHOLDS[0] == 0.05 and DEFAULT_THRESHOLDS[-1] == 0.95 and len(DEFAULT_THRESHOLDS) == 19


def test_choose_threshold_ties_go_to_the_one_nearest_one_half():
    # Every threshold in (0.2, 0.8] is perfect here; 0.5 itself is among them.
    assert choose_threshold([[0.9], [0.1, 0.9]], [-1, 0]) == (0.5, 1.0)
    # Perfect only at 0.45 and 0.55 (equally near): the smaller wins.
    assert choose_threshold([[0.56], [0.44]], [-1, 0], candidates=[0.45, 0.55, 0.7]) == (0.45, 1.0)


def test_choose_threshold_with_one_kind_of_solution_maximises_its_accuracy():
    assert choose_threshold([[0.9, 0.3]], [1], candidates=[0.2, 0.5, 0.95]) == (0.5, 1.0)
    with pytest.raises(ValueError, match="empty dev split"):
        choose_threshold([], [])


def test_aggregate_steps():
    assert aggregate_steps([0.9, 0.5, 0.8], "min") == 0.5
    assert aggregate_steps([0.9, 0.5, 0.8], "last") == 0.8
    assert aggregate_steps([0.9, 0.5, 0.8], "product") == pytest.approx(0.36)
    with pytest.raises(ValueError, match="no step scores"):
        aggregate_steps([], "min")
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregate_steps([0.5], "mean")


@dataclass
class Candidate:
    answer: str | None
    correct: bool
    step_scores: list[float]


# Per problem: min / last / product of each candidate, and who wins.
GROUPS = [
    [  # min: b (0.7, wrong); last: c (0.95, right); product: c (0.57 > 0.56 > 0.27); vote "12" x2 (right)
        {"answer": "12", "correct": True, "step_scores": [0.9, 0.3]},
        {"answer": "10", "correct": False, "step_scores": [0.8, 0.7]},
        {"answer": "12", "correct": True, "step_scores": [0.6, 0.95]},
    ],
    [  # min: b (0.6, right); last: a (0.9, wrong); product: b (0.51 > 0.4 > 0.225); vote "5" x2 (wrong)
        {"answer": "5", "correct": False, "step_scores": [0.5, 0.5, 0.9]},
        {"answer": "7", "correct": True, "step_scores": [0.85, 0.6]},
        {"answer": "5", "correct": False, "step_scores": [0.4]},
    ],
    [  # min: b (0.3, wrong); last: b (0.9, wrong); product: b (0.27 > 0.2 > 0.09); vote: "3" and "4" tie, "3" first
        {"answer": None, "correct": False, "step_scores": [0.2]},
        {"answer": "3", "correct": False, "step_scores": [0.3, 0.9]},
        {"answer": "4", "correct": True, "step_scores": [0.9, 0.1]},
    ],
]


def test_best_of_n_three_problems_by_hand():
    result = best_of_n(GROUPS)
    assert result["prm_at_n_min"] == pytest.approx(1 / 3)
    assert result["prm_at_n_last"] == pytest.approx(1 / 3)
    assert result["prm_at_n_product"] == pytest.approx(2 / 3)
    assert result["prm_at_n"] == result["prm_at_n_min"]
    assert result["maj_at_n"] == pytest.approx(1 / 3)
    assert result["pass_at_n"] == 1.0
    assert result["n"] == 3 and result["problems"] == 3


def test_best_of_n_ties_and_candidate_objects():
    third = [Candidate(**c) for c in GROUPS[2]]
    # The vote tie now meets "4" first; objects with attributes work as well as dicts.
    assert best_of_n([[third[0], third[2], third[1]]])["maj_at_n"] == 1.0
    assert best_of_n([third])["maj_at_n"] == 0.0
    # Equal aggregated scores: the first candidate wins.
    tied = [Candidate("1", False, [0.5]), Candidate("2", True, [0.5])]
    assert best_of_n([tied])["prm_at_n"] == 0.0 and best_of_n([tied[::-1]])["prm_at_n"] == 1.0
    # No answer at all: the vote is wrong. Groups of different sizes: n is the mean size.
    result = best_of_n([[Candidate(None, False, [0.1])], tied])
    assert result["maj_at_n"] == 0.0 and result["n"] == 1.5 and result["pass_at_n"] == 0.5


def test_best_of_n_errors():
    with pytest.raises(ValueError, match="problem 1 has no candidates"):
        best_of_n([GROUPS[0], []])
    with pytest.raises(ValueError, match="problem 0: aggregate_steps: no step scores"):
        best_of_n([[Candidate("1", True, [])]])
    with pytest.raises(ValueError, match="no problems"):
        best_of_n([])


def test_label_agreement():
    assert label_agreement([[True, False, True], [False]], [[True, True, True], [False]]) == 0.75
    with pytest.raises(ValueError, match="example 0 has 1 predicted labels but 2 true labels"):
        label_agreement([[True]], [[True, False]])
    with pytest.raises(ValueError, match="no steps"):
        label_agreement([], [])


def test_auroc_counts_the_pairs_a_score_orders_right_ties_half():
    # good steps 0.9 and 0.4 against bad 0.4 and 0.2: pairs (0.9>0.4) (0.9>0.2) (0.4=0.4: half) (0.4>0.2) -> 3.5 / 4
    assert auroc([0.9, 0.4, 0.4, 0.2], [True, True, False, False]) == pytest.approx(0.875)
    assert auroc([0.1, 0.2, 0.9], [True, True, False]) == 0.0 and auroc([0.3, 0.3], [True, False]) == 0.5
    assert auroc([0.5, 0.6], [True, True]) is None  # one class: nothing to rank
    with pytest.raises(ValueError, match="3 scores for 2 labels"):
        auroc([0.1, 0.2, 0.3], [True, False])


def test_prm_eval_reports_the_auroc_against_the_labels_and_against_the_truth_beside_them():
    from prm.evaluate import data_report
    from prm.examples import StepExample

    examples = [StepExample(prompt="p", steps=["a", "b"], labels=[True, False], extra={"true_labels": [True, True]}),
                StepExample(prompt="q", steps=["c"], labels=[True], extra={"true_labels": [False]})]
    report = data_report(examples, [[0.9, 0.2], [0.4]], dev_fraction=0.0)
    assert report["step_auroc"] == 1.0  # labels good 0.9, 0.4 over bad 0.2
    assert report["true_step_auroc"] == 0.5  # truth good 0.9, 0.2 against bad 0.4: one pair of two right
    assert report["label_agreement"] == pytest.approx(1 / 3)
