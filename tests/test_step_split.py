"""Step splitting: separators stay with the step before, lookaheads cut before, the join gives the text back."""

import random

import pytest

from grpo_mega.data.step_split import DOUBLE_NEWLINE_PATTERN, SYNTHETIC_STEP_PATTERN, split_steps, step_char_ends
from grpo_mega.data.synthetic import Difficulty, generate_problems


def test_synthetic_solution_splits_into_its_steps_and_the_answer_sentence():
    text = " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."
    assert split_steps(text, SYNTHETIC_STEP_PATTERN) == [
        " Step 1: 7 + 5 = 12.",
        " Step 2: 12 * 3 = 36.",
        " The answer is 36.",
    ]


def test_synthetic_reference_solutions_have_one_step_per_operation_plus_the_answer():
    for problem in generate_problems(50, seed=3, difficulty=Difficulty(min_steps=1, max_steps=4)):
        steps = split_steps(problem.solution, SYNTHETIC_STEP_PATTERN)
        assert "".join(steps) == problem.solution
        assert len(steps) == len(problem.steps) + 1
        assert steps[-1] == f" The answer is {problem.answer}."


def test_generated_text_with_junk_before_and_doubled_spaces():
    text = "ok  Step 1: 2 + 2 = 5.   Step 2: 5 - 1 = 4.The answer is 4. trailing"
    assert split_steps(text, SYNTHETIC_STEP_PATTERN) == [
        "ok",
        "  Step 1: 2 + 2 = 5.",
        "   Step 2: 5 - 1 = 4.",
        "The answer is 4. trailing",
    ]


def test_separator_stays_with_the_step_before():
    text = "First.\n\nSecond.\n\nThird."
    assert split_steps(text, DOUBLE_NEWLINE_PATTERN) == ["First.\n\n", "Second.\n\n", "Third."]
    # A separator followed by more blank lines: the extra whitespace ends the same step, it is never a step.
    assert split_steps("a\n\n\n\nb", DOUBLE_NEWLINE_PATTERN) == ["a\n\n\n\n", "b"]
    # A trailing separator ends the last step; a leading one is joined to the first real step.
    assert split_steps("a\n\n", DOUBLE_NEWLINE_PATTERN) == ["a\n\n"]
    assert split_steps("\n\na", DOUBLE_NEWLINE_PATTERN) == ["\n\na"]


def test_no_match_empty_and_whitespace_texts():
    assert split_steps("no separator here", DOUBLE_NEWLINE_PATTERN) == ["no separator here"]
    assert split_steps("", DOUBLE_NEWLINE_PATTERN) == []
    assert split_steps("", SYNTHETIC_STEP_PATTERN) == []
    assert split_steps("\n\n\n\n", DOUBLE_NEWLINE_PATTERN) == ["\n\n\n\n"]


@pytest.mark.parametrize("pattern", [SYNTHETIC_STEP_PATTERN, DOUBLE_NEWLINE_PATTERN, r"\.", r"(?=x)|y+", r" *"])
def test_join_gives_the_text_back_and_no_step_is_blank(pattern):
    rng = random.Random(0)
    alphabet = ["Step 1:", "Step 22:", "The answer is", "\n\n", "\n", " ", "  ", ".", "x", "yy", "a", "7"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        steps = split_steps(text, pattern)
        assert "".join(steps) == text
        assert all(steps)
        if not text.isspace():
            assert not any(step.isspace() for step in steps)


def test_step_char_ends_are_cumulative_exclusive_ends():
    steps = [" Step 1: 7 + 5 = 12.", " Step 2: 12 * 3 = 36.", " The answer is 36."]
    ends = step_char_ends(steps)
    assert ends == [20, 41, 59]
    text = "".join(steps)
    assert [text[:end] for end in ends] == ["".join(steps[: k + 1]) for k in range(3)]
    assert step_char_ends([]) == []


def test_bad_pattern_error_names_it():
    with pytest.raises(ValueError, match=r"step pattern '\(Step' is not a valid regular expression"):
        split_steps("Step 1: x", "(Step")
