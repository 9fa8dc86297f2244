"""Ground-truth step labels of the synthetic task, planted-error solutions, and policy completions as examples."""

import random
import re

import pytest

from grpo_mega.data.synthetic import Difficulty, Problem, Step, apply_operator, generate_problems
from prm.examples import first_error_of
from prm.synthetic import (
    value_step_labels,
    planted_error_examples,
    planted_error_solution,
    solution_steps,
    synthetic_examples,
    true_step_labels,
)

# "Q: Start with 7. Add 5. Multiply by 3. A:", answer 36.
PROBLEM = Problem(start=7, steps=(Step(7, "+", 5, 12), Step(12, "*", 3, 36)))


def truth(text: str) -> list[bool]:
    return true_step_labels(PROBLEM, solution_steps(text))


@pytest.mark.parametrize(
    "text, labels",
    [
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36.", [True, True, True]),
        # Wrong arithmetic, then a faithful carry of the wrong value: both steps wrong, and so is the answer.
        (" Step 1: 7 + 5 = 13. Step 2: 13 * 3 = 39. The answer is 39.", [False, False, False]),
        # A wrong carry alone (12 read as 11).
        (" Step 1: 7 + 5 = 12. Step 2: 11 * 3 = 33. The answer is 33.", [True, False, False]),
        # A wrong step, yet the stated answer is right: the answer sentence is judged by its value only.
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 35. The answer is 36.", [True, False, True]),
        # The wrong operation (multiply instead of add).
        (" Step 1: 7 * 5 = 35. Step 2: 35 * 3 = 105. The answer is 105.", [False, False, False]),
        # An extra step beyond the problem's operations.
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. Step 3: 36 + 0 = 36. The answer is 36.", [True, True, False, True]),
        # No answer sentence.
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36.", [True, True]),
        # Trailing text inside a step makes it unparseable.
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. so 36", [True, False]),
        # Junk before the first step; a step numbered out of place.
        ("Hmm. Step 1: 7 + 5 = 12. Step 3: 12 * 3 = 36. The answer is 36.", [False, True, False, True]),
        # Steps after the final answer are not part of the solution.
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36. Step 3: 1 + 1 = 2.", [True, True, True, False]),
        # Only the first stated answer counts (as is_correct reads it).
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 35. The answer is 36.", [True, True, False, False]),
        (" The answer is 36.", [True]),
        (" The answer is 35.", [False]),
        ("", []),
    ],
)
def test_true_step_labels_hand_worked(text, labels):
    assert truth(text) == labels


def test_true_step_labels_of_a_step_holding_two_steps():
    # "Step2:" is not a split point (the pattern wants "Step 2:") but parse_solution reads it as a step.
    steps = [" Step 1: 7 + 5 = 12. Step2: 12 * 3 = 36.", " The answer is 36."]
    assert true_step_labels(PROBLEM, steps) == [False, True]


@pytest.mark.parametrize(
    "text, statement, value",
    [
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36.", [True, True, True], [True, True, True]),
        # a wrong expression with the right result: wrong by the checker, right by the value it carries on
        (" Step 1: 7 + 4 = 12. Step 2: 12 * 3 = 36. The answer is 36.", [False, True, True], [True, True, True]),
        (" Step 1: 7 - 5 = 12. Step 2: 12 * 3 = 36. The answer is 36.", [False, True, True], [True, True, True]),
        # a wrong value, then a wrong carry that lands on the right value again
        (" Step 1: 7 + 5 = 13. Step 2: 13 * 3 = 36. The answer is 36.", [False, False, True], [False, True, True]),
        # a wrong value carried on faithfully: wrong by both
        (" Step 1: 7 + 5 = 13. Step 2: 13 * 3 = 39. The answer is 39.", [False, False, False], [False, False, False]),
        # misnumbered, extra or unparseable steps and stray text are bad by both
        (" Step 2: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36.", [False, True, True], [False, True, True]),
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. Step 3: 36 * 1 = 36. The answer is 36.",
         [True, True, False, True], [True, True, False, True]),
        (" Step 1: twelve. Step 2: 12 * 3 = 36. The answer is 36.", [False, True, True], [False, True, True]),
        (" hmm Step 1: 7 + 5 = 12. The answer is 12.", [False, True, False], [False, True, False]),
    ],
)
def test_value_step_labels_judge_a_step_by_the_value_it_carries_on(text, statement, value):
    steps = solution_steps(text)
    assert true_step_labels(PROBLEM, steps) == statement
    assert value_step_labels(PROBLEM, steps) == value


def test_planted_error_solution_carries_the_wrong_value_forward():
    problem = Problem(start=4, steps=(Step(4, "+", 2, 6), Step(6, "*", 3, 18), Step(18, "-", 5, 13)))
    text = planted_error_solution(problem, 1, random.Random(0))
    equations = re.findall(r"Step (\d): (\d+) ([+*-]) (\d+) = (\d+)\.", text)
    assert [e[:4] for e in equations] == [("1", "4", "+", "2"), ("2", "6", "*", "3"), ("3", equations[1][4], "-", "5")]
    wrong = int(equations[1][4])
    assert wrong != 18 and 0 <= wrong and abs(wrong - 18) <= 9
    assert int(equations[2][4]) == wrong - 5
    assert text.endswith(f" The answer is {wrong - 5}.")
    assert true_step_labels(problem, solution_steps(text)) == [True, False, False, False]
    assert planted_error_solution(problem, -1, random.Random(0)) == problem.solution


def test_planted_error_that_leads_back_to_the_right_answer():
    problem = Problem(start=4, steps=(Step(4, "+", 2, 6), Step(6, "*", 0, 0)))
    text = planted_error_solution(problem, 0, random.Random(1))
    assert text.endswith(" The answer is 0.") and " Step 1: 4 + 2 = 6." not in text
    assert true_step_labels(problem, solution_steps(text)) == [False, False, True]


def test_planted_error_examples_are_processbench_rows_with_the_truth():
    problems = generate_problems(300, seed=5, difficulty=Difficulty(min_steps=1, max_steps=4, operand_range=(0, 9)))
    examples = planted_error_examples(problems, seed=11, error_fraction=0.5)
    assert examples == planted_error_examples(problems, seed=11, error_fraction=0.5)
    assert examples != planted_error_examples(problems, seed=12, error_fraction=0.5)
    planted = [e for e in examples if e.first_error != -1]
    assert 0.4 < len(planted) / len(examples) < 0.6
    for problem, example in zip(problems, examples):
        assert example.prompt == problem.prompt and example.answer == str(problem.answer)
        assert example.labels == true_step_labels(problem, example.steps)
        assert first_error_of(example.labels) == example.first_error
        assert len(example.steps) == len(problem.steps) + 1
        values = [int(v) for v in re.findall(r"= (-?\d+)\.", "".join(example.steps))]
        assert min(values) >= 0
        if example.first_error == -1:
            assert "".join(example.steps) == problem.solution
        else:
            k = example.first_error
            assert values[k] != problem.steps[k].result
            # Later steps compute correctly from the carried wrong value; the answer is the value reached.
            for j in range(k + 1, len(problem.steps)):
                assert values[j] == apply_operator(values[j - 1], problem.steps[j].op, problem.steps[j].rhs)
            assert example.steps[-1] == f" The answer is {values[-1]}."
    assert all(e.first_error == -1 for e in planted_error_examples(problems[:20], seed=0, error_fraction=0.0))
    assert all(e.first_error >= 0 for e in planted_error_examples(problems[:20], seed=0, error_fraction=1.0))
    with pytest.raises(ValueError, match="error_fraction"):
        planted_error_examples(problems, seed=0, error_fraction=1.5)


def test_synthetic_examples_from_policy_completions():
    completions = [" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 35. The answer is 35.", " The answer is 36.", ""]
    examples = synthetic_examples([PROBLEM] * 3, completions)
    assert examples[0].steps == [" Step 1: 7 + 5 = 12.", " Step 2: 12 * 3 = 35.", " The answer is 35."]
    assert examples[0].labels == [True, False, False] == examples[0].extra["true_labels"]
    assert examples[0].answer == "36" and examples[0].prompt == PROBLEM.prompt
    assert Problem.from_record(examples[0].extra) == PROBLEM  # the extra fields rebuild the problem
    assert examples[1].labels == [True]
    assert examples[2].steps == [] and examples[2].labels == []
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        synthetic_examples([PROBLEM] * 2, completions[:1])
