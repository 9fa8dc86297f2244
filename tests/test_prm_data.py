"""PRM data readers on hand-written rows in the published schemas: how questions and steps are split, how labels
are read, malformed rows (file:line, skip or raise), format detection, and the stepwise round trip."""

import json
from pathlib import Path

import pytest

from grpo_mega.data.prompts import BadRowError
from grpo_mega.data.synthetic import Problem, Step, write_jsonl
from prm.data import FORMATS, detect_format, read_examples, write_stepwise
from prm.examples import StepExample
from prm.rendering import RenderSettings, render

FIXTURES = Path(__file__).parent / "fixtures" / "prm"


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.jsonl"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in fixture(name).read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------- Math-Shepherd
def test_math_shepherd_question_steps_and_labels():
    examples = read_examples(fixture("math_shepherd"), "math_shepherd")
    assert len(examples) == 3
    robe = examples[1]
    assert robe.prompt == (
        "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?"
    )
    assert robe.steps == [
        " Step 1: It takes 2 / 2 = <<2/2=1>>1 bolt of white fiber.",
        "\nStep 2: So it takes 2 * 1 = <<2*1=2>>2 bolts in total.",
        "\nStep 3: The answer is: 2",
    ]
    assert robe.labels == [True, False, False]
    assert robe.extra == {"task": "GSM8K"}
    assert robe.source == f"{fixture('math_shepherd')}:2"
    assert [len(e.steps) for e in examples] == [4, 3, 3]
    assert examples[0].labels == [True] * 4 and examples[2].labels == [True] * 3
    assert examples[2].steps[0] == " Step 1: I know that $\\sqrt{16} = 4$."


def test_math_shepherd_rendering_with_its_tag_writes_the_published_input_back():
    for example, row in zip(read_examples(fixture("math_shepherd"), "math_shepherd"), rows("math_shepherd")):
        text, ends = render(example.prompt, example.steps, RenderSettings(step_tag=" ки"))
        assert text == row["input"]
        assert [text[end - 2 : end] for end in ends] == ["ки"] * len(example.steps)


def test_math_shepherd_first_step_marker_is_configurable(tmp_path):
    path = tmp_path / "ms.jsonl"
    row = {"input": "What is 1+1? 1. Add: 2. ки\n2. Done: 2 ки", "label": "What is 1+1? 1. Add: 2. +\n2. Done: 2 -"}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(BadRowError, match=r"ms.jsonl:1: math_shepherd row: no 'Step 1:' before the first tag"):
        read_examples(path, "math_shepherd", on_bad_row="error")
    [example] = read_examples(path, "math_shepherd", first_step_marker="1. ")
    assert example.prompt == "What is 1+1?"
    assert example.steps == [" 1. Add: 2.", "\n2. Done: 2"] and example.labels == [True, False]


def test_math_shepherd_bad_rows_skipped_or_raised():
    path = fixture("math_shepherd_bad")
    why = "math_shepherd row: field 'label' has 'к' where step 1's tag is"
    with pytest.raises(BadRowError, match=rf"{path}:2: {why}"):
        read_examples(path, "math_shepherd", on_bad_row="error")
    examples = read_examples(path, "math_shepherd", on_bad_row="skip")
    assert [e.source for e in examples] == [f"{path}:1"]


def test_bad_row_messages_name_file_and_line(caplog):
    path = fixture("math_shepherd_bad")
    read_examples(path, "math_shepherd")
    warnings = [r.getMessage() for r in caplog.records]
    assert any(f"{path}:3: invalid JSON" in w for w in warnings)
    assert any(f"{path}:4: math_shepherd row: no 'Step 1:'" in w for w in warnings)
    assert any("skipped 3 of 4 rows" in w for w in warnings)


# ----------------------------------------------------------------------------- PRM800K
def test_prm800k_follows_the_labellers_path_and_stops_at_the_first_error():
    divisors, number, sums, fraction = read_examples(fixture("prm800k"), "prm800k")
    # Phase-2 row: the step rated -1 has no chosen completion (the labeller stopped); it is the last step.
    assert divisors.prompt == "How many positive divisors does $6!$ have?"
    assert divisors.steps[-1] == "But 720 itself should not count, so the answer is 29."
    assert divisors.labels == [True, True, False, False]  # the neutral third step is bad by default
    assert divisors.extra["ratings"] == [1, 1, 0, -1] and divisors.extra["finish_reason"] == "found_error"
    assert divisors.answer == "30" and divisors.extra["generation"] == 9
    # Phase-1 row: the chosen completion, then the human's own step where no completion was chosen.
    assert number.steps == [
        "Let the number be $n$.", "Then $2n + 3 = 11$, so $2n = 8$.", "So $n = 4$.", "# Answer\n\n4"
    ]
    assert number.labels == [True, True, True, True] and number.extra["ratings"] == [1, 1, 1, 1]
    # A chosen step rated -1 ends the solution: the later step is not kept.
    assert sums.steps == ["$1 + 2 = 3$.", "$3 + 3 = 9$."] and sums.labels == [True, False]
    # Gave up: no completion chosen and none rated -1, so the solution ends before that step.
    assert fraction.steps == ["Both 4 and 8 are divisible by 4."] and fraction.labels == [True]
    assert fraction.answer == "\\frac{1}{2}"


def test_prm800k_neutral_rating_mapping():
    divisors = read_examples(fixture("prm800k"), "prm800k", neutral_is_good=True)[0]
    assert divisors.labels == [True, True, True, False]


def read_line_alone(tmp_path: Path, name: str, line: int, format: str) -> list[StepExample]:
    """Line ``line`` of fixture ``name`` as a one-row file, read with on_bad_row="error"."""
    path = tmp_path / f"{name}_line{line}.jsonl"
    path.write_text(fixture(name).read_text(encoding="utf-8").splitlines()[line - 1] + "\n", encoding="utf-8")
    return read_examples(path, format, on_bad_row="error")


@pytest.mark.parametrize(
    "line, why",
    [
        (2, r"prm800k row: label.steps\[1\].completions\[0\].rating must be -1, 0, 1 or null, got 2"),
        (3, "prm800k row: missing field 'question'"),
        (4, r"prm800k row: no rated step on the labeller's path"),  # its only step has rating null
    ],
)
def test_prm800k_bad_rows(tmp_path, line, why):
    path = fixture("prm800k_bad")
    assert [e.source for e in read_examples(path, "prm800k")] == [f"{path}:1"]
    with pytest.raises(BadRowError, match=rf"_line{line}.jsonl:1: {why}"):
        read_line_alone(tmp_path, "prm800k_bad", line, "prm800k")


# ----------------------------------------------------------------------------- stepwise and ProcessBench
def test_stepwise_rows():
    plain, labelled, unlabelled = read_examples(fixture("stepwise"), "stepwise")
    assert plain.steps[1] == "Compare the tenths: 1 < 9, so 9.9 is larger." and plain.labels == [True, True, True]
    assert plain.soft_labels is None and plain.first_error is None and plain.answer is None and plain.extra == {}
    assert labelled.labels == [False, False] and labelled.soft_labels == [0.125, 0.0]
    assert labelled.first_error == 0 and labelled.answer == "4" and labelled.extra == {"outcome": 0.0}
    assert unlabelled.labels is None and unlabelled.steps == ["6 * 7 = 42.", "The answer is 42."]


@pytest.mark.parametrize(
    "line, why",
    [
        (2, "field 'completions' must be a non-empty list of strings"),
        (3, "field 'labels' must be a list of 2 booleans"),
        (4, r"field 'soft_labels' must be 1 numbers in \[0, 1\]"),
        (5, "field 'first_error' is 1 but the labels' first bad step is 0"),
    ],
)
def test_stepwise_bad_rows(tmp_path, line, why):
    path = fixture("stepwise_bad")
    assert [e.source for e in read_examples(path, "stepwise")] == [f"{path}:1"]
    with pytest.raises(BadRowError, match=why):
        read_line_alone(tmp_path, "stepwise_bad", line, "stepwise")


def test_processbench_rows_keep_the_first_error_and_no_labels():
    wrong, right, first = read_examples(fixture("processbench"), "processbench")
    assert wrong.first_error == 1 and right.first_error == -1 and first.first_error == 0
    assert all(e.labels is None for e in (wrong, right, first))
    assert wrong.steps[1] == "He eats 2, so 12 - 2 = 11 apples are left."
    assert wrong.extra == {"id": "gsm8k-0", "generator": "Qwen2-7B-Instruct", "final_answer_correct": False}


def test_processbench_bad_rows(tmp_path):
    path = fixture("processbench_bad")
    assert [e.source for e in read_examples(path, "processbench")] == [f"{path}:1"]
    why = "processbench row: field 'label' must be -1 or a step index below 3, got 3"
    with pytest.raises(BadRowError, match=rf"{path}:2: {why}"):
        read_examples(path, "processbench", on_bad_row="error")
    with pytest.raises(BadRowError, match="field 'steps' must be a non-empty list of strings"):
        read_line_alone(tmp_path, "processbench_bad", 3, "processbench")
    with pytest.raises(BadRowError, match="field 'label' must be -1 or a step index below 3, got None"):
        read_line_alone(tmp_path, "processbench_bad", 4, "processbench")


# ----------------------------------------------------------------------------- synthetic
def test_synthetic_task_rows_get_true_labels(tmp_path):
    problem = Problem(start=7, steps=(Step(7, "+", 5, 12), Step(12, "*", 3, 36)))
    path = write_jsonl([problem, problem], tmp_path / "task.jsonl", styles=["worked", "direct"])
    worked, direct = read_examples(path, "synthetic")
    assert worked.prompt == "Q: Start with 7. Add 5. Multiply by 3. A:"
    assert worked.steps == [" Step 1: 7 + 5 = 12.", " Step 2: 12 * 3 = 36.", " The answer is 36."]
    assert worked.labels == [True, True, True] and worked.answer == "36"
    assert worked.extra["steps"][1] == {"lhs": 12, "op": "*", "rhs": 3, "result": 36}
    assert direct.steps == [" The answer is 36."] and direct.labels == [True]
    completion_row = dict(problem.to_record(), completion=" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 35. The answer is 35.")
    path.write_text(json.dumps(completion_row) + "\n" + json.dumps(dict(problem.to_record(), answer="37")) + "\n")
    [policy] = read_examples(path, "synthetic")
    assert policy.labels == [True, False, False] and "solution" in policy.extra
    why = "synthetic row: field 'answer' is '37' but the steps' chain ends"
    with pytest.raises(BadRowError, match=rf"task.jsonl:2: {why}"):
        read_examples(path, "synthetic", on_bad_row="error")


# ----------------------------------------------------------------------------- detection, options, writing
@pytest.mark.parametrize("name", ["math_shepherd", "prm800k", "stepwise", "processbench"])
def test_auto_detects_every_fixture(name):
    assert detect_format(rows(name)[0]) == name
    assert read_examples(fixture(name), "auto") == read_examples(fixture(name), name)


def test_detect_format_synthetic_and_its_stepwise_output():
    record = Problem(start=2, steps=(Step(2, "+", 2, 4),)).to_record()
    assert detect_format(record) == "synthetic"
    assert detect_format(dict(record, completions=["x"])) == "stepwise"  # a labelled synthetic row written stepwise


def test_detect_format_errors():
    with pytest.raises(ValueError, match=r"ambiguous between the PRM data formats \['math_shepherd', 'prm800k'\]; pass the format"):
        detect_format({"input": "x", "question": {}, "label": {}})
    with pytest.raises(ValueError, match=r"fields \['text'\] matches no PRM data format"):
        detect_format({"text": "x"})
    with pytest.raises(ValueError, match="expected a JSON object"):
        detect_format(["x"])


def test_format_and_option_errors():
    with pytest.raises(ValueError, match="unknown PRM data format 'shepherd'"):
        read_examples(fixture("math_shepherd"), "shepherd")
    with pytest.raises(ValueError, match=r"unknown format options \['neutral_is_bad'\]"):
        read_examples(fixture("prm800k"), "prm800k", neutral_is_bad=True)
    with pytest.raises(ValueError, match=r"options \['neutral_is_good'\] do not apply to format 'stepwise'"):
        read_examples(fixture("stepwise"), "stepwise", neutral_is_good=True)
    # Under "auto" an option of another format is ignored (callers pass PRM800K's option whatever the file is).
    assert len(read_examples(fixture("stepwise"), "auto", neutral_is_good=True)) == 3
    assert read_examples(fixture("prm800k"), "auto", neutral_is_good=True)[0].labels == [True, True, True, False]
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        read_examples(fixture("stepwise"), "stepwise", on_bad_row="ignore")


@pytest.mark.parametrize("name", FORMATS[:4])
def test_write_stepwise_round_trips(tmp_path, name):
    examples = read_examples(fixture(name), name)
    out = write_stepwise(tmp_path / "sub" / "out.jsonl", examples)
    again = read_examples(out, "stepwise")
    assert [e.source for e in again] == [f"{out}:{i}" for i in range(1, len(examples) + 1)]
    for example in again:
        example.source = ""
    for example in examples:
        example.source = ""
    assert again == examples


def test_write_stepwise_layout_and_clashes(tmp_path):
    example = StepExample(prompt="p", steps=["a", "b"], labels=[True, False], soft_labels=[0.5, 0.0], first_error=1,
                          answer="3", extra={"true_labels": [True, True]})
    path = write_stepwise(tmp_path / "out.jsonl", [example])
    assert json.loads(path.read_text()) == {
        "prompt": "p", "completions": ["a", "b"], "labels": [True, False], "soft_labels": [0.5, 0.0],
        "first_error": 1, "answer": "3", "true_labels": [True, True],
    }
    with pytest.raises(ValueError, match=r"x.jsonl:3: extra fields \['labels'\] clash"):
        clash = StepExample(prompt="p", steps=["a"], source="x.jsonl:3", extra={"labels": 1})
        write_stepwise(tmp_path / "bad.jsonl", [clash])
