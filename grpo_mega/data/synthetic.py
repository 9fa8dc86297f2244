"""The synthetic multi-step arithmetic task: problems, reference solutions, parsing and step-level ground truth.

A problem is a chain of operations written in words; its reference solution does one operation per step:

    prompt:   "Q: Start with 7. Add 5. Multiply by 3. A:"
    solution: " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."

Every step can be checked, so a generated solution gets ground-truth step labels (for scoring a PRM's automatic
labels and predictions) as well as an outcome (is the final answer right). The surface form is chosen for a
~1M-parameter model: one sentence per operation in the question, operations in the order they are applied,
small non-negative integers, and per-digit tokens (see ``grpo_mega.data.tokenizer``).
"""

from __future__ import annotations

import enum
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from grpo_mega.data.tool_format import TOOL_CALL_OPEN

OPERATORS = ("+", "-", "*")
# One fixed sentence per operator keeps the word -> symbol mapping trivially learnable.
_OPERATOR_WORDS = {"+": "Add {x}.", "-": "Subtract {x}.", "*": "Multiply by {x}."}
SOLUTION_STYLES = ("worked", "direct")
_PROMPT_PREFIX = "Q:"
_PROMPT_SUFFIX = " A:"

_STEP_MARKER = re.compile(r"Step\s*(\d+)\s*:")
_ANSWER_MARKER = re.compile(r"The answer is\s*(-?\d+)")
_STEP_BODY = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*\.?\s*$")


@dataclass(frozen=True)
class Difficulty:
    """How hard the generated problems are.

    Every intermediate value stays within ``[0, max_value]``: an operation that would leave that range is never
    drawn, so a problem is a chain ``v_0 = start, v_k = v_{k-1} op_k x_k`` with ``0 <= v_k <= max_value``.
    """

    min_steps: int = 2
    """Fewest operations (= solution steps) in a problem."""
    max_steps: int = 2
    """Most operations in a problem; the count is drawn uniformly from [min_steps, max_steps]."""
    start_range: tuple[int, int] = (2, 9)
    """Inclusive range of the starting number."""
    operand_range: tuple[int, int] = (2, 9)
    """Inclusive range of each operation's operand."""
    operators: tuple[str, ...] = OPERATORS
    """Operators drawn from, a subset of "+", "-", "*"."""
    max_value: int = 99
    """Largest allowed intermediate or final value."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"Difficulty: need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        for name in ("start_range", "operand_range"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"Difficulty.{name}: need 0 <= low <= high, got ({low}, {high})")
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(f"Difficulty.operators: need a non-empty subset of {OPERATORS}, got {self.operators}")
        if self.start_range[1] > self.max_value:
            raise ValueError(f"Difficulty: start_range {self.start_range} exceeds max_value {self.max_value}")

    @classmethod
    def from_dict(cls, values: dict) -> "Difficulty":
        """Build from a config mapping; list values become tuples and unknown keys raise ValueError."""
        known = set(cls.__dataclass_fields__)
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"Difficulty: unknown settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True)
class Step:
    """One operation of a solution: ``lhs op rhs = result``."""

    lhs: int
    op: str
    rhs: int
    result: int

    def text(self) -> str:
        """The step's equation as written in solutions, e.g. ``"7 + 5 = 12"``."""
        return f"{self.lhs} {self.op} {self.rhs} = {self.result}"


def apply_operator(lhs: int, op: str, rhs: int) -> int:
    """``lhs op rhs`` for op in "+", "-", "*"."""
    if op == "+":
        return lhs + rhs
    if op == "-":
        return lhs - rhs
    if op == "*":
        return lhs * rhs
    raise ValueError(f"unknown operator {op!r}; expected one of {OPERATORS}")


@dataclass(frozen=True)
class Problem:
    """A chain problem with its reference steps; ``answer`` is the last step's result."""

    start: int
    steps: tuple[Step, ...]

    @property
    def question(self) -> str:
        """The problem in words, e.g. ``"Start with 7. Add 5. Multiply by 3."``."""
        sentences = [f"Start with {self.start}."]
        sentences += [_OPERATOR_WORDS[s.op].format(x=s.rhs) for s in self.steps]
        return " ".join(sentences)

    @property
    def prompt(self) -> str:
        """The text the policy is given; its completion starts right after it."""
        return f"{_PROMPT_PREFIX} {self.question}{_PROMPT_SUFFIX}"

    @property
    def answer(self) -> int:
        """The final value of the chain."""
        return self.steps[-1].result

    @property
    def solution(self) -> str:
        """The reference completion, starting with a space so that ``prompt + solution`` reads naturally."""
        parts = [f" Step {k}: {s.text()}." for k, s in enumerate(self.steps, start=1)]
        return "".join(parts) + f" The answer is {self.answer}."

    @property
    def direct_solution(self) -> str:
        """A completion that states the answer without working the steps, e.g. ``" The answer is 36."``."""
        return f" The answer is {self.answer}."

    def to_record(self, solution_style: str = "worked") -> dict:
        """The jsonl row: ``prompt``, ``answer`` (a string, as for real datasets), ``steps``, ``solution`` (the
        SFT target: ``solution`` when ``solution_style`` is "worked", ``direct_solution`` when "direct") and
        ``solution_style``."""
        if solution_style not in SOLUTION_STYLES:
            raise ValueError(f"solution_style must be one of {SOLUTION_STYLES}, got {solution_style!r}")
        return {
            "prompt": self.prompt,
            "answer": str(self.answer),
            "steps": [{"lhs": s.lhs, "op": s.op, "rhs": s.rhs, "result": s.result} for s in self.steps],
            "solution": self.solution if solution_style == "worked" else self.direct_solution,
            "solution_style": solution_style,
        }

    @classmethod
    def from_record(cls, record: dict) -> "Problem":
        """Rebuild a problem from its jsonl row; inconsistent steps raise ValueError."""
        try:
            steps = tuple(Step(int(s["lhs"]), str(s["op"]), int(s["rhs"]), int(s["result"])) for s in record["steps"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"synthetic record: malformed 'steps' field ({error!r}): {record!r}") from error
        if not steps:
            raise ValueError(f"synthetic record: empty 'steps': {record!r}")
        problem = cls(start=steps[0].lhs, steps=steps)
        for k, step in enumerate(steps):
            expected_lhs = problem.start if k == 0 else steps[k - 1].result
            if step.lhs != expected_lhs or apply_operator(step.lhs, step.op, step.rhs) != step.result:
                raise ValueError(f"synthetic record: step {k + 1} ({step.text()}) does not follow the chain: {record!r}")
        return problem


def _draw_problem(rng: random.Random, difficulty: Difficulty) -> Problem:
    """One problem; operations are drawn uniformly from those that keep the value within [0, max_value]."""
    num_steps = rng.randint(difficulty.min_steps, difficulty.max_steps)
    value = rng.randint(*difficulty.start_range)
    start, steps = value, []
    low, high = difficulty.operand_range
    for _ in range(num_steps):
        feasible = [
            (op, x)
            for op in difficulty.operators
            for x in range(low, high + 1)
            if 0 <= apply_operator(value, op, x) <= difficulty.max_value
        ]
        if not feasible:
            raise ValueError(f"Difficulty {difficulty}: no operation keeps {value} within [0, {difficulty.max_value}]")
        op, x = rng.choice(feasible)
        result = apply_operator(value, op, x)
        steps.append(Step(value, op, x, result))
        value = result
    return Problem(start=start, steps=tuple(steps))


def generate_problems(count: int, seed: int, difficulty: Difficulty = Difficulty()) -> list[Problem]:
    """``count`` problems drawn from ``difficulty`` with a private RNG seeded by ``seed`` (deterministic).

    Questions may repeat; use ``make_splits`` for distinct, disjoint train and held-out sets.
    """
    if count < 0:
        raise ValueError(f"generate_problems: count must be >= 0, got {count}")
    rng = random.Random(seed)
    return [_draw_problem(rng, difficulty) for _ in range(count)]


def make_splits(
    num_train: int, num_heldout: int, seed: int, difficulty: Difficulty = Difficulty()
) -> tuple[list[Problem], list[Problem]]:
    """Train and held-out problems with pairwise distinct questions, so the two splits never share a question.

    Draws until ``num_train + num_heldout`` distinct questions are found; the first ``num_heldout`` distinct ones
    form the held-out split. Raises ValueError when the difficulty has too few distinct questions.
    """
    wanted = num_train + num_heldout
    rng = random.Random(seed)
    seen: dict[str, Problem] = {}
    # Distinct questions run out for small settings; stop after many consecutive repeats instead of looping forever.
    misses, max_misses = 0, 1000 + 20 * wanted
    while len(seen) < wanted:
        problem = _draw_problem(rng, difficulty)
        if problem.question in seen:
            misses += 1
            if misses > max_misses:
                raise ValueError(
                    f"make_splits: found only {len(seen)} distinct questions for {difficulty}, "
                    f"but {wanted} were requested (num_train={num_train}, num_heldout={num_heldout})"
                )
            continue
        misses = 0
        seen[problem.question] = problem
    problems = list(seen.values())
    return problems[num_heldout:], problems[:num_heldout]


class StepVerdict(enum.Enum):
    """Why a generated step is right or wrong, checked against the problem's reference step."""

    CORRECT = "correct"
    UNPARSEABLE = "unparseable"  # not "lhs op rhs = result", or its "Step N:" number is not its position
    EXTRA = "extra"  # more steps than the problem has
    WRONG_OPERATION = "wrong_operation"  # operator or operand differ from the problem's k-th operation
    WRONG_CARRY = "wrong_carry"  # left operand is not the true value after the previous operations
    WRONG_ARITHMETIC = "wrong_arithmetic"  # lhs op rhs != result


@dataclass(frozen=True)
class ParsedStep:
    """A step found in generated text. ``start``/``end`` are character offsets (``end`` exclusive, after the
    step's trailing period when present); the equation fields are None when the body does not parse."""

    number: int
    body: str
    start: int
    end: int
    lhs: int | None = None
    op: str | None = None
    rhs: int | None = None
    result: int | None = None

    @property
    def parsed(self) -> bool:
        """Whether the body is an equation ``lhs op rhs = result``."""
        return self.lhs is not None


@dataclass(frozen=True)
class ParsedSolution:
    """Steps and final answer found in a completion; ``answer`` is None when there is no "The answer is N"."""

    steps: list[ParsedStep] = field(default_factory=list)
    answer: int | None = None
    answer_end: int | None = None
    """Character offset just after the answer sentence (after its period when present)."""


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def parse_solution(text: str) -> ParsedSolution:
    """Split a completion into "Step N: ..." segments and the first "The answer is N" sentence.

    A step runs from its marker to the next marker, the answer sentence or the next ``<tool_call>`` (a tool
    trajectory calls the calculator between steps: ``grpo_mega.data.tool_task``); text after the answer is ignored.
    """
    answer_match = _ANSWER_MARKER.search(text)
    limit = answer_match.start() if answer_match else len(text)
    markers = [m for m in _STEP_MARKER.finditer(text) if m.start() < limit]
    steps = []
    for i, marker in enumerate(markers):
        segment_end = markers[i + 1].start() if i + 1 < len(markers) else limit
        call = text.find(TOOL_CALL_OPEN, marker.end(), segment_end)
        segment_end = call if call >= 0 else segment_end
        body = text[marker.end() : segment_end]
        end = marker.end() + len(body.rstrip())
        equation = _STEP_BODY.match(body)
        fields = {}
        if equation:
            lhs, op, rhs, result = equation.groups()
            fields = {"lhs": int(lhs), "op": op, "rhs": int(rhs), "result": int(result)}
        steps.append(ParsedStep(number=int(marker.group(1)), body=body.strip(), start=marker.start(), end=end, **fields))
    answer = answer_end = None
    if answer_match:
        answer = _int_or_none(answer_match.group(1))
        answer_end = answer_match.end() + (1 if text[answer_match.end() : answer_match.end() + 1] == "." else 0)
    return ParsedSolution(steps=steps, answer=answer, answer_end=answer_end)


def check_steps(problem: Problem, text: str) -> list[StepVerdict]:
    """A verdict for every step of ``text``, checked against ``problem``'s k-th reference step.

    Step k is CORRECT iff it reads ``v_{k-1} op_k x_k = v_k`` with the problem's own operation and the *true*
    carried value ``v_{k-1}``: a step that faithfully carries an earlier mistake is WRONG_CARRY, because the
    solution cannot reach the right answer from it.
    """
    verdicts = []
    for position, step in enumerate(parse_solution(text).steps, start=1):
        if position > len(problem.steps):
            verdicts.append(StepVerdict.EXTRA)
            continue
        reference = problem.steps[position - 1]
        if not step.parsed or step.number != position:
            verdicts.append(StepVerdict.UNPARSEABLE)
        elif (step.op, step.rhs) != (reference.op, reference.rhs):
            verdicts.append(StepVerdict.WRONG_OPERATION)
        elif step.lhs != reference.lhs:
            verdicts.append(StepVerdict.WRONG_CARRY)
        elif apply_operator(step.lhs, step.op, step.rhs) != step.result:
            verdicts.append(StepVerdict.WRONG_ARITHMETIC)
        else:
            verdicts.append(StepVerdict.CORRECT)
    return verdicts


def step_labels(problem: Problem, text: str) -> list[bool]:
    """Ground-truth label of every generated step: arithmetically correct and consistent with the problem."""
    return [verdict is StepVerdict.CORRECT for verdict in check_steps(problem, text)]


def step_end_offsets(text: str) -> list[int]:
    """Character offset where each step of ``text`` ends (exclusive), for mapping steps to token indices."""
    return [step.end for step in parse_solution(text).steps]


def is_correct(problem: Problem, text: str) -> bool:
    """Whether the completion's final answer ("The answer is N") equals the problem's answer."""
    return parse_solution(text).answer == problem.answer


def write_jsonl(problems: Iterable[Problem], path: str | Path, styles: Sequence[str] | None = None) -> Path:
    """Write one ``Problem.to_record(style)`` per line (every style "worked" unless ``styles`` is given)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    problems = list(problems)
    styles = ["worked"] * len(problems) if styles is None else list(styles)
    if len(styles) != len(problems):
        raise ValueError(f"write_jsonl: {len(styles)} solution styles for {len(problems)} problems")
    with path.open("w", encoding="utf-8") as handle:
        for problem, style in zip(problems, styles):
            handle.write(json.dumps(problem.to_record(style)) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Problem]:
    """Read problems written by ``write_jsonl``; a bad line raises ValueError naming file and line."""
    problems = []
    with Path(path).open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                problems.append(Problem.from_record(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as error:
                raise ValueError(f"{path}:{line_number}: {error}") from error
    return problems


def task_texts(problems: Sequence[Problem]) -> list[str]:
    """Prompt + reference solution of each problem: the corpus a tokenizer for the task is trained on."""
    return [problem.prompt + problem.solution for problem in problems]
