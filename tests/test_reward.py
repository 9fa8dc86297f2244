"""Rewards: math answer verification, format and synthetic rewards, user functions by path, compute_rewards."""

import math
import threading

import numpy as np
import pytest
import torch

from grpo_mega.reward import REWARD_FUNCTIONS, RewardError, compute_rewards, get_reward_function
from grpo_mega.reward.format import boxed_format_reward, follows_step_format, step_format_reward
from grpo_mega.reward.math_answer import (
    answers_match,
    extract_boxed,
    extract_gold_answer,
    math_verify_reward,
    parse_number,
)
from grpo_mega.reward.synthetic import synthetic_reward

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    "gold, completion, expected",
    [
        ("#### 42", "so the result is #### 42", True),
        ("#### 42", "The answer is 42.", True),
        ("#### 42", "#### 41", False),
        ("#### 42", "I think 42 first, then #### 41", False),
        (GSM8K_GOLD, "24 + 48 = 72\n#### 72", True),
        (GSM8K_GOLD, "#### 24", False),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{\\frac{1}{2}}", "So x = \\boxed{0.5}.", True),
        ("0.5", "the answer is \\boxed{\\frac{1}{2}}", True),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
        ("\\sqrt{2}", "\\boxed{\\sqrt 2}", True),
        ("1,000", "#### 1000", True),
        ("#### 42", "no number here", False),
        ("#### 42", "", False),
    ],
)
def test_answers_match(gold, completion, expected):
    assert answers_match(gold, completion) is expected
    assert math_verify_reward("p", completion, gold) == float(expected)


def test_plain_number_fallback_when_math_verify_finds_nothing():
    # math-verify extracts nothing from "the total is (7)"; the last plain numbers are compared exactly.
    assert answers_match("the total is (7)", "7")
    assert answers_match("the total is (7)", "#### (7)")
    assert not answers_match("the total is (7)", "8")
    # Text golds are not read as LaTeX products of letters.
    assert answers_match("about 7 apples", "it must be 7 apples")


def test_math_verify_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(answers_match("\\frac{1}{2}", "\\boxed{0.5}")))
    thread.start()
    thread.join()
    assert results == [True]


def test_answer_extraction_helpers():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\boxed{\\frac{1}{2}") is None
    assert extract_boxed("no box") is None
    assert extract_gold_answer(GSM8K_GOLD) == "72"
    assert extract_gold_answer(" \\boxed{3} ") == "3"
    assert extract_gold_answer("17") == "17"
    assert parse_number("1,234.5 then 3/4") == 0.75
    assert parse_number("x = -2") == -2
    assert parse_number("none") is None


def test_step_format():
    good = " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."
    assert follows_step_format(good) and step_format_reward("p", good, "36") == 1.0
    # Format only: a wrong result still has the right format.
    assert follows_step_format(" Step 1: 7 + 5 = 13. The answer is 13.")
    for bad in [
        " Step 2: 7 + 5 = 12. The answer is 12.",  # numbering must start at 1
        " Step 1: 7 + 5 = 12. Step 1: 12 * 3 = 36. The answer is 36.",  # and increase
        " Step 1: 7 + 5 = 12.",  # no answer
        " The answer is 36.",  # no steps
        " Step 1: 7 + 5 = 12. The answer is 12. Extra words",
        " Step 1: seven. The answer is 7.",
    ]:
        assert step_format_reward("p", bad, "36") == 0.0, bad


def test_boxed_format():
    assert boxed_format_reward("p", "so \\boxed{\\frac{1}{2}}.", "x") == 1.0
    assert boxed_format_reward("p", "no box", "x") == 0.0
    assert boxed_format_reward("p", "\\boxed{1} or \\boxed{2}", "x") == 0.0
    assert boxed_format_reward("p", "\\boxed{ }", "x") == 0.0
    assert boxed_format_reward("p", "\\boxed{1", "x") == 0.0


def test_synthetic_reward():
    assert synthetic_reward("p", " Step 1: 7 + 5 = 12. The answer is 12.", "12") == 1.0
    assert synthetic_reward("p", " Step 1: 7 + 5 = 12. The answer is 13.", "12") == 0.0
    assert synthetic_reward("p", " Step 1: 7 + 5 = 12.", "12") == 0.0
    with pytest.raises(ValueError, match="gold answer 'twelve' is not an integer"):
        synthetic_reward("p", "The answer is 12.", "twelve")


def test_registry_names():
    assert {"math_verify", "synthetic", "step_format", "boxed_format"} <= set(REWARD_FUNCTIONS)
    assert get_reward_function("synthetic") is synthetic_reward
    with pytest.raises(ValueError, match="unknown reward function 'synthtic'"):
        get_reward_function("synthtic")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_penalty(prompt, completion, answer, **extra):\n"
        "    return -len(completion) / 100\n"
        "class Holder:\n"
        "    @staticmethod\n"
        "    def nested(prompt, completion, answer, **extra):\n"
        "        return 1.0\n"
        "THRESHOLD = 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_user_function_by_path(user_module):
    function = get_reward_function(f"{user_module}:length_penalty")
    assert function("p", "x" * 50, "a") == -0.5
    assert get_reward_function(f"{user_module}:Holder.nested")("p", "c", "a") == 1.0


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("no_such_module_xyz:fn", ImportError, "cannot import module 'no_such_module_xyz'"),
        ("my_rewards:missing", AttributeError, "has no attribute 'missing'"),
        ("my_rewards:THRESHOLD", TypeError, "is a float, not callable"),
        ("my_rewards:", ValueError, "expected 'package.module:function'"),
    ],
)
def test_user_function_errors(user_module, spec, error, message):
    with pytest.raises(error, match=message):
        get_reward_function(spec)


def test_compute_rewards_returns_a_float_tensor_and_passes_extras():
    def reward(prompt, completion, answer, **extra):
        return {0: 1, 1: True, 2: np.float64(0.25), 3: torch.tensor(0.5)}[extra["row"]]

    rewards = compute_rewards(reward, ["a"] * 4, ["c"] * 4, ["x"] * 4, extras=[{"row": i} for i in range(4)])
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 1.0, 0.25, 0.5]
    completions = [" Step 1: 2 + 3 = 5. The answer is 5.", "The answer is 6."]
    assert compute_rewards(synthetic_reward, ["p", "p"], completions, ["5", "5"]).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("bad_value", [math.nan, math.inf, "1.0", None, [1.0]])
def test_compute_rewards_rejects_non_numbers_naming_the_sample(bad_value):
    def reward(prompt, completion, answer, **extra):
        return bad_value if prompt.startswith("second") else 1.0

    prompts = ["first prompt", "second prompt " + "x" * 200]
    with pytest.raises(RewardError, match=r"for sample 1 \(prompt 'second prompt x+\.\.\.'\); expected a finite number"):
        compute_rewards(reward, prompts, ["c", "c"], ["a", "a"])


def test_compute_rewards_reports_a_raising_function():
    def reward(prompt, completion, answer, **extra):
        return 1.0 / len(completion)

    with pytest.raises(RewardError, match=r"raised on sample 2 \(prompt 'third'\): ZeroDivisionError") as info:
        compute_rewards(reward, ["first", "second", "third"], ["a", "b", ""], ["1", "1", "1"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_compute_rewards_checks_batch_sizes():
    with pytest.raises(ValueError, match="batch sizes differ: 2 prompts, 1 completions"):
        compute_rewards(synthetic_reward, ["a", "b"], ["c"], ["1"])
