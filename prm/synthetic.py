"""Ground truth for PRM work on the synthetic arithmetic task (``grpo_mega.data.synthetic``).

A solution's steps are the pieces of ``split_steps(text, SYNTHETIC_STEP_PATTERN)``: each "Step k: ..." sentence,
the final "The answer is N." sentence, and whatever else the text holds (junk before the first step). The true label
of a piece:

- a "Step k:" piece is good iff ``check_steps`` finds it CORRECT (right operation on the true carried value, right
  arithmetic) and it holds no other step;
- the piece with the final answer (the first "The answer is N", as ``parse_solution`` reads it) is good iff N is the
  problem's answer;
- any other piece (text before the first step, steps or answers after the final answer) is bad.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Sequence

from grpo_mega.data.step_split import SYNTHETIC_STEP_PATTERN, split_steps, step_char_ends
from grpo_mega.data.synthetic import (
    ParsedStep,
    Problem,
    Step,
    StepVerdict,
    apply_operator,
    check_steps,
    parse_solution,
)
from prm.examples import StepExample, first_error_of

_STEP_START = re.compile(r"\s*Step \d+:")


def solution_steps(text: str) -> list[str]:
    """The steps of a synthetic-task solution (``split_steps`` with ``SYNTHETIC_STEP_PATTERN``)."""
    return split_steps(text, SYNTHETIC_STEP_PATTERN)


def _label_pieces(problem: Problem, steps: Sequence[str], good_step: Callable[[int, ParsedStep], bool]) -> list[bool]:
    """The label of every piece by the rules of the module docstring, a lone "Step k:" piece judged by
    ``good_step(position, parsed step)`` (position: 1-based among the steps the text holds)."""
    text = "".join(steps)
    parsed = parse_solution(text)
    step_at = {step.start: (position, step) for position, step in enumerate(parsed.steps, start=1)}
    labels = []
    for piece, end in zip(steps, step_char_ends(list(steps))):
        begin = end - len(piece)
        if parsed.answer_end is not None and begin < parsed.answer_end <= end:
            labels.append(parsed.answer == problem.answer)
        elif _STEP_START.match(piece):
            found = step_at.get(begin + len(piece) - len(piece.lstrip()))
            alone = sum(begin <= start < end for start in step_at) == 1
            labels.append(alone and found is not None and good_step(*found))
        else:
            labels.append(False)
    return labels


def true_step_labels(problem: Problem, steps: Sequence[str]) -> list[bool]:
    """Ground-truth label of every piece of a partitioned solution (rules in the module docstring)."""
    verdicts = check_steps(problem, "".join(steps))
    return _label_pieces(problem, steps, lambda position, _: verdicts[position - 1] is StepVerdict.CORRECT)


def value_step_labels(problem: Problem, steps: Sequence[str]) -> list[bool]:
    """The truth by value: like ``true_step_labels``, except that a "Step k:" piece is good iff it is alone, numbered
    k and its result is the true value after the problem's k-th operation, whatever its left-hand side (e.g.
    "Step 1: 5 - 4 = 2." for "Start with 5. Subtract 3." is good: it writes a wrong expression, but the value it
    carries on is right). This is the truth a Monte-Carlo label estimates (whether the answer can still be
    reached from the step), so the statement truth and this one differ exactly on the steps no completer can
    call bad."""

    def carries_the_true_value(position: int, step: ParsedStep) -> bool:
        return step.number == position <= len(problem.steps) and step.result == problem.steps[position - 1].result

    return _label_pieces(problem, steps, carries_the_true_value)


def _record(steps: Sequence[Step]) -> list[dict]:
    return [{"lhs": s.lhs, "op": s.op, "rhs": s.rhs, "result": s.result} for s in steps]


def _chain_stays_non_negative(value: int, later: Sequence[Step]) -> bool:
    for step in later:
        value = apply_operator(value, step.op, step.rhs)
        if value < 0:
            return False
    return True


def _wrong_result(rng: random.Random, true_result: int, later: Sequence[Step]) -> int:
    """A result within 9 of the true one, different, non-negative, and keeping the later values non-negative."""
    candidates = [
        value
        for value in range(max(0, true_result - 9), true_result + 10)
        if value != true_result and _chain_stays_non_negative(value, later)
    ]
    return rng.choice(candidates)  # never empty: a larger value keeps every later value larger too


def planted_error_solution(problem: Problem, error_step: int, rng: random.Random) -> str:
    """The reference solution with a wrong result at operation ``error_step`` (0-based; -1: none); later steps carry
    the wrong value and compute correctly from it, and the answer sentence gives the value reached."""
    value, written = problem.start, []
    for index, reference in enumerate(problem.steps):
        result = apply_operator(value, reference.op, reference.rhs)
        if index == error_step:
            result = _wrong_result(rng, result, problem.steps[index + 1 :])
        written.append(Step(value, reference.op, reference.rhs, result))
        value = result
    return "".join(f" Step {k}: {s.text()}." for k, s in enumerate(written, start=1)) + f" The answer is {value}."


def planted_error_examples(problems: Sequence[Problem], seed: int, error_fraction: float = 0.5) -> list[StepExample]:
    """Solutions with planted errors as ProcessBench rows with ground-truth labels; deterministic in ``seed``.

    With probability ``error_fraction`` a problem's solution gets a wrong result at a uniformly drawn operation k
    (``planted_error_solution``) and ``first_error = k``, else it is the reference solution and ``first_error = -1``.
    ``labels`` are the truth (``true_step_labels``): every later step is a wrong carry; the answer sentence is good
    only when the wrong value happens to lead back to the right answer (e.g. a later "* 0").
    """
    if not 0.0 <= error_fraction <= 1.0:
        raise ValueError(f"planted_error_examples: error_fraction must be in [0, 1], got {error_fraction}")
    rng = random.Random(seed)
    examples = []
    for index, problem in enumerate(problems):
        error_step = rng.randrange(len(problem.steps)) if rng.random() < error_fraction else -1
        steps = solution_steps(planted_error_solution(problem, error_step, rng))
        labels = true_step_labels(problem, steps)
        if first_error_of(labels) != error_step:  # the planted step is the first wrong one by construction
            raise AssertionError(f"planted error at step {error_step} but truth {labels} for {problem}")
        examples.append(
            StepExample(
                prompt=problem.prompt,
                steps=steps,
                labels=labels,
                first_error=error_step,
                answer=str(problem.answer),
                source=f"planted:{index}",
                extra={"steps": _record(problem.steps)},
            )
        )
    return examples


def synthetic_examples(problems: Sequence[Problem], completions: Sequence[str]) -> list[StepExample]:
    """Policy completions as examples labelled with the truth (``labels`` and ``extra["true_labels"]``)."""
    if len(problems) != len(completions):
        raise ValueError(f"synthetic_examples: {len(problems)} problems but {len(completions)} completions")
    examples = []
    for index, (problem, completion) in enumerate(zip(problems, completions)):
        steps = solution_steps(completion)
        truth = true_step_labels(problem, steps)
        examples.append(
            StepExample(
                prompt=problem.prompt,
                steps=steps,
                labels=truth,
                answer=str(problem.answer),
                source=f"completion:{index}",
                extra={"true_labels": list(truth), "steps": _record(problem.steps)},
            )
        )
    return examples


def example_from_synthetic_row(row: dict) -> StepExample:
    """A synthetic-task row (``prompt``, ``answer``, ``steps`` records, ``completion`` or else ``solution``) as an
    example with ground-truth labels; the other fields, ``steps`` included, go to ``extra``. ValueError when bad."""
    if not isinstance(row.get("prompt"), str):
        raise ValueError(f"field 'prompt' must be a string, got {row.get('prompt')!r:.80}")
    text_field = "completion" if "completion" in row else "solution"
    text = row.get(text_field)
    if not isinstance(text, str):
        raise ValueError(f"field {text_field!r} must be a string, got {text!r:.80}")
    problem = Problem.from_record(row)
    if row.get("answer") is not None and str(row["answer"]) != str(problem.answer):
        raise ValueError(f"field 'answer' is {row['answer']!r} but the steps' chain ends at {problem.answer}")
    steps = solution_steps(text)
    if not steps:
        raise ValueError(f"field {text_field!r} is empty")
    extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", text_field)}
    return StepExample(prompt=row["prompt"], steps=steps, labels=true_step_labels(problem, steps),
                       answer=str(problem.answer), extra=extra)
