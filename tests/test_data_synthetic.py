"""The synthetic arithmetic task: generation, splits, parsing, step labels (hand-checked), jsonl round trip."""

import json

import pytest

from grpo_mega.data.synthetic import (
    Difficulty,
    Problem,
    Step,
    StepVerdict,
    check_steps,
    generate_problems,
    is_correct,
    make_splits,
    parse_solution,
    read_jsonl,
    step_end_offsets,
    step_labels,
    write_jsonl,
)

# Start with 7. Add 5. Multiply by 3.  ->  7 + 5 = 12, 12 * 3 = 36.
PROBLEM = Problem(start=7, steps=(Step(7, "+", 5, 12), Step(12, "*", 3, 36)))
REFERENCE = " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."


def test_problem_surface_form():
    assert PROBLEM.prompt == "Q: Start with 7. Add 5. Multiply by 3. A:"
    assert PROBLEM.solution == REFERENCE
    assert PROBLEM.answer == 36


def test_generation_is_deterministic_and_within_difficulty():
    difficulty = Difficulty(min_steps=1, max_steps=3, start_range=(2, 9), operand_range=(2, 5), max_value=40)
    first = generate_problems(200, seed=3, difficulty=difficulty)
    assert first == generate_problems(200, seed=3, difficulty=difficulty)
    assert first != generate_problems(200, seed=4, difficulty=difficulty)
    assert {len(p.steps) for p in first} == {1, 2, 3}
    for problem in first:
        assert 2 <= problem.start <= 9
        value = problem.start
        for step in problem.steps:
            assert step.lhs == value and 2 <= step.rhs <= 5 and 0 <= step.result <= 40
            value = step.result
        assert problem.answer == value


def test_splits_never_share_a_question():
    train, heldout = make_splits(500, 100, seed=0)
    assert len(train) == 500 and len(heldout) == 100
    train_questions = {p.question for p in train}
    assert len(train_questions) == 500
    assert train_questions.isdisjoint(p.question for p in heldout)
    assert (train, heldout) == make_splits(500, 100, seed=0)


def test_splits_too_large_for_difficulty_raise():
    tiny = Difficulty(min_steps=1, max_steps=1, start_range=(2, 3), operand_range=(2, 3), operators=("+",))
    with pytest.raises(ValueError, match="found only 4 distinct questions"):
        make_splits(4, 1, seed=0, difficulty=tiny)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"min_steps": 3, "max_steps": 2}, "min_steps"),
        ({"operand_range": (5, 2)}, "operand_range"),
        ({"operators": ("/",)}, "operators"),
        ({"start_range": (2, 200)}, "max_value"),
    ],
)
def test_bad_difficulty_raises(settings, message):
    with pytest.raises(ValueError, match=message):
        Difficulty(**settings)


def test_difficulty_from_dict_rejects_unknown_keys():
    assert Difficulty.from_dict({"operand_range": [2, 5]}).operand_range == (2, 5)
    with pytest.raises(ValueError, match="unknown settings \\['steps'\\]"):
        Difficulty.from_dict({"steps": 2})


def test_reference_solution_parses_and_is_all_correct():
    parsed = parse_solution(REFERENCE)
    assert [(s.number, s.lhs, s.op, s.rhs, s.result) for s in parsed.steps] == [(1, 7, "+", 5, 12), (2, 12, "*", 3, 36)]
    assert parsed.answer == 36
    assert step_labels(PROBLEM, REFERENCE) == [True, True]
    assert is_correct(PROBLEM, REFERENCE)


@pytest.mark.parametrize(
    "text, verdicts, correct",
    [
        # wrong arithmetic in step 1; step 2 then carries a value that is not the true 12
        (
            " Step 1: 7 + 5 = 13. Step 2: 13 * 3 = 39. The answer is 39.",
            [StepVerdict.WRONG_ARITHMETIC, StepVerdict.WRONG_CARRY],
            False,
        ),
        # right step 1, then a wrong carried value (21 instead of 12), computed correctly
        (" Step 1: 7 + 5 = 12. Step 2: 21 * 3 = 63. The answer is 63.", [StepVerdict.CORRECT, StepVerdict.WRONG_CARRY], False),
        # right carry, wrong operation (+ instead of *)
        (" Step 1: 7 + 5 = 12. Step 2: 12 + 3 = 15. The answer is 15.", [StepVerdict.CORRECT, StepVerdict.WRONG_OPERATION], False),
        # right arithmetic chain, wrong final answer sentence
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 35.", [StepVerdict.CORRECT, StepVerdict.CORRECT], False),
        # missing answer sentence: steps are still labelled, the outcome is wrong
        (" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36.", [StepVerdict.CORRECT, StepVerdict.CORRECT], False),
        # a step that is not an equation; the outcome only looks at the answer
        (" Step 1: seven plus five. Step 2: 12 * 3 = 36. The answer is 36.", [StepVerdict.UNPARSEABLE, StepVerdict.CORRECT], True),
        # steps numbered out of order
        (" Step 2: 7 + 5 = 12. The answer is 36.", [StepVerdict.UNPARSEABLE], True),
        # one step too many
        (
            " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. Step 3: 36 + 0 = 36. The answer is 36.",
            [StepVerdict.CORRECT, StepVerdict.CORRECT, StepVerdict.EXTRA],
            True,
        ),
        # garbage
        ("%%% 12 = = *", [], False),
        ("", [], False),
    ],
)
def test_hand_checked_step_verdicts(text, verdicts, correct):
    assert check_steps(PROBLEM, text) == verdicts
    assert step_labels(PROBLEM, text) == [v is StepVerdict.CORRECT for v in verdicts]
    assert is_correct(PROBLEM, text) is correct


def test_text_after_the_answer_is_ignored():
    text = REFERENCE + " Step 3: 1 + 1 = 3. The answer is 7."
    assert parse_solution(text).answer == 36
    assert step_labels(PROBLEM, text) == [True, True]


def test_step_end_offsets_are_hand_checked():
    offsets = step_end_offsets(REFERENCE)
    assert offsets == [len(" Step 1: 7 + 5 = 12."), len(" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36.")] == [20, 41]
    parsed = parse_solution(REFERENCE)
    assert parsed.answer_end == len(REFERENCE)
    # A step without a period ends at its last non-space character.
    assert step_end_offsets(" Step 1: 7 + 5 = 12  Step 2: x") == [19, 30]


def test_negative_numbers_parse():
    problem = Problem(start=3, steps=(Step(3, "-", 5, -2),))
    assert step_labels(problem, " Step 1: 3 - 5 = -2. The answer is -2.") == [True]
    assert is_correct(problem, " Step 1: 3 - 5 = -2. The answer is -2.")


def test_jsonl_round_trip(tmp_path):
    problems = generate_problems(20, seed=1)
    path = write_jsonl(problems, tmp_path / "train.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"prompt", "answer", "steps", "solution", "solution_style"}
    assert rows[0]["answer"] == str(problems[0].answer)
    assert read_jsonl(path) == problems


def test_inconsistent_jsonl_record_names_file_and_line(tmp_path):
    good = PROBLEM.to_record()
    bad = dict(good, steps=[{"lhs": 7, "op": "+", "rhs": 5, "result": 13}])
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*step 1 \(7 \+ 5 = 13\)"):
        read_jsonl(path)


def test_build_synthetic_task_writes_loadable_files(tmp_path):
    from transformers import AutoTokenizer

    from grpo_mega.data.build import build_synthetic_task

    files = build_synthetic_task(tmp_path / "task", num_train=200, num_heldout=20, seed=3)
    train, heldout = read_jsonl(files.train), read_jsonl(files.heldout)
    assert (len(train), len(heldout)) == (200, 20)
    assert {p.question for p in train}.isdisjoint(p.question for p in heldout)
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer))
    text = heldout[0].prompt + heldout[0].solution
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_direct_answer_fraction_mixes_sft_targets_of_the_train_split_only(tmp_path):
    from grpo_mega.data.build import build_synthetic_task

    files = build_synthetic_task(tmp_path / "a", num_train=200, num_heldout=20, seed=3, direct_answer_fraction=0.3)
    rows = [json.loads(line) for line in files.train.read_text().splitlines()]
    direct = [row for row in rows if row["solution_style"] == "direct"]
    assert len(direct) == 60
    for row in rows:
        problem = Problem.from_record(row)
        assert is_correct(problem, row["solution"])  # both styles state the right answer
        expected = problem.direct_solution if row["solution_style"] == "direct" else problem.solution
        assert row["solution"] == expected
    assert direct[0]["solution"] == f" The answer is {direct[0]['answer']}."
    assert step_labels(Problem.from_record(direct[0]), direct[0]["solution"]) == []  # no steps worked
    assert {json.loads(line)["solution_style"] for line in files.heldout.read_text().splitlines()} == {"worked"}
    # same seed, same choice of rows; the problems do not depend on the fraction
    again = build_synthetic_task(tmp_path / "b", num_train=200, num_heldout=20, seed=3, direct_answer_fraction=0.3)
    assert again.train.read_text() == files.train.read_text()
    plain = build_synthetic_task(tmp_path / "c", num_train=200, num_heldout=20, seed=3)
    assert [json.loads(line)["prompt"] for line in plain.train.read_text().splitlines()] == [r["prompt"] for r in rows]
    with pytest.raises(ValueError, match="direct_answer_fraction"):
        build_synthetic_task(tmp_path / "d", num_train=20, num_heldout=2, seed=3, direct_answer_fraction=1.5)
    with pytest.raises(ValueError, match="solution_style"):
        Problem.from_record(rows[0]).to_record("terse")
