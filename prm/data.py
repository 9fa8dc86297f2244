"""Readers for PRM data files (jsonl or parquet), all returning ``StepExample``s, and the stepwise writer.

Formats (``FORMATS``), one row each, as published:

- ``math_shepherd``: ``input`` is the question followed by the solution, every step followed by the tag "ки"
  (``"Q ... Step 1: ... ки\\nStep 2: ... ки"``); ``label`` is the same text with each tag replaced by "+" or "-".
  The prompt is the text before the first ``first_step_marker`` (default "Step 1:"), without its trailing
  whitespace; that whitespace starts the first step. A step is the text between two tags without the whitespace
  just before its tag, so rendering with ``step_tag=" ки"`` writes the published input back exactly. The label
  text must equal the input with only the tags replaced, else the row is bad.
- ``prm800k`` (OpenAI PRM800K, phase 1 and 2): ``question.problem``; ``label.steps[i]`` has ``completions``
  (``text``, ``rating`` -1/0/+1 or null), ``chosen_completion`` and ``human_completion``. The steps are the path the
  labeller followed: the chosen completion; when none was chosen, the human's own step (``human_completion``; rated
  good when its rating is null); when neither (the labeller stopped), the first completion rated -1 if any, else the
  solution ends before that step. The solution also ends at the first step rated -1 (that step included: later steps
  follow a wrong one and PRM800K leaves them unlabelled) and before a chosen step whose rating is null. Rating +1 is
  good, -1 bad, 0 good only with ``neutral_is_good`` (Qwen2.5-Math-PRM's choice; TRL's conversion counts only +1,
  the default). ``extra`` keeps the raw ``ratings`` and ``finish_reason``; ``answer`` is ``ground_truth_answer``.
- ``stepwise`` (TRL): ``prompt``, ``completions`` (the steps), ``labels`` (bools; null or absent when unknown),
  optional ``soft_labels``, ``first_error``, ``answer``; every other field goes to ``extra``. ``write_stepwise``
  writes this layout. A turn-split row (``prm label --steps turns``) also has ``turn_steps`` (``prm.turn_steps``:
  the response's token ids and each step's last model token), checked here: step ends past its tokens, out of
  order, or not one per step make the row bad.
- ``processbench``: ``problem``, ``steps``, ``label`` (index of the earliest wrong step, -1 if none). Labels past
  the first error are unknown, so ``labels`` stays None and ``first_error`` holds ``label``; ``id``, ``generator``
  and ``final_answer_correct`` go to ``extra``.
- ``synthetic``: rows of the synthetic arithmetic task (``prompt``, ``answer``, ``steps`` records and a
  ``solution`` or ``completion``), labelled with the ground truth; see ``prm.synthetic``.

Steps are kept as written: PRM800K, stepwise and ProcessBench steps carry no separator, the step tag written after
each one separates them (as in TRL and Qwen2.5-Math-PRM). Malformed rows name ``file:line`` and are skipped or
raised per ``on_bad_row`` (``grpo_mega.data.prompts.BadRows``).

``replay_mix`` composes a training set of fresh rows plus a replayed share of earlier ones (``data.replay_files``).
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

from grpo_mega.data.prompts import BadRows, read_rows
from prm.examples import StepExample, first_error_of
from prm.synthetic import example_from_synthetic_row
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps

MATH_SHEPHERD_TAG = "ки"


class RowError(ValueError):
    """Why one row cannot be read (the caller adds ``file:line``)."""


# ----------------------------------------------------------------------------- field checks
def _field(row: dict, name: str, kind: type, what: str) -> Any:
    if name not in row:
        raise RowError(f"missing field {name!r} (fields: {sorted(row)})")
    value = row[name]
    if not isinstance(value, kind):
        raise RowError(f"field {name!r} must be {what}, got {value!r:.80}")
    return value


def _string_list(row: dict, name: str) -> list[str]:
    values = _field(row, name, list, "a non-empty list of strings")
    if not values or not all(isinstance(v, str) for v in values):
        raise RowError(f"field {name!r} must be a non-empty list of strings, got {values!r:.80}")
    return list(values)


def _optional_answer(row: dict, name: str = "answer") -> str | None:
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        raise RowError(f"field {name!r} must be a string or number, got {value!r:.80}")
    return str(value)


def _bool_list(values: Any, name: str, count: int) -> list[bool]:
    if not isinstance(values, list) or len(values) != count:
        raise RowError(f"field {name!r} must be a list of {count} booleans (one per step), got {values!r:.80}")
    if not all(isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)) for v in values):
        raise RowError(f"field {name!r} must hold booleans (or 0/1), got {values!r:.80}")
    return [bool(v) for v in values]


def _first_error(value: Any, name: str, count: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < count:
        raise RowError(f"field {name!r} must be -1 or a step index below {count}, got {value!r:.80}")
    return value


# ----------------------------------------------------------------------------- one reader per format
def math_shepherd_example(
    row: dict, *, tag: str = MATH_SHEPHERD_TAG, first_step_marker: str = "Step 1:"
) -> StepExample:
    """One Math-Shepherd row (see the module docstring for the split of question and steps)."""
    text = _field(row, "input", str, "a string")
    label_text = _field(row, "label", str, "a string")
    pieces = text.split(tag)
    if len(pieces) < 2:
        raise RowError(f"field 'input' has no step tag {tag!r}")
    if pieces[-1].strip():
        raise RowError(f"field 'input' has text after its last step tag {tag!r}: {pieces[-1]!r:.60}")
    marker = pieces[0].find(first_step_marker)
    if marker < 0:
        raise RowError(f"no {first_step_marker!r} before the first tag in field 'input' (set first_step_marker)")
    prompt_end = len(pieces[0][:marker].rstrip())
    pieces[0] = pieces[0][prompt_end:]
    prompt = text[:prompt_end]
    if not prompt.strip():
        raise RowError(f"field 'input' has no question before {first_step_marker!r}")
    # The label text is the input with each tag replaced by one "+"/"-" character: walk both in step.
    labels, position = [], prompt_end
    for index, piece in enumerate(pieces[:-1]):
        if label_text[position : position + len(piece)] != piece:
            raise RowError(f"field 'label' differs from 'input' in step {index} (character {position} of 'label')")
        position += len(piece)
        mark = label_text[position : position + 1]
        if mark not in ("+", "-"):
            raise RowError(f"field 'label' has {mark!r} where step {index}'s tag is, expected '+' or '-'")
        labels.append(mark == "+")
        position += 1
    if label_text[:prompt_end] != prompt or label_text[position:] != pieces[-1]:
        raise RowError("field 'label' is not the 'input' text with its tags replaced by '+'/'-'")
    steps = [piece.rstrip(" ") for piece in pieces[:-1]]
    if not all(s.strip() for s in steps):
        raise RowError(f"field 'input' has an empty step (two tags {tag!r} in a row)")
    extra = {k: v for k, v in row.items() if k not in ("input", "label")}
    return StepExample(prompt=prompt, steps=steps, labels=labels, extra=extra)


_RATINGS = (-1, 0, 1, None)


def _rating(completion: Any, where: str) -> int | None:
    if not isinstance(completion, dict) or not isinstance(completion.get("text"), str):
        raise RowError(f"{where} must be an object with a string 'text', got {completion!r:.80}")
    rating = completion.get("rating")
    if rating not in _RATINGS or isinstance(rating, bool):
        raise RowError(f"{where}.rating must be -1, 0, 1 or null, got {rating!r}")
    return rating


def _prm800k_step(step: Any, index: int) -> tuple[str, int | None] | None:
    """(text, rating) of the step the labeller followed at ``label.steps[index]``; None: the solution ends here."""
    where = f"label.steps[{index}]"
    if not isinstance(step, dict) or not isinstance(step.get("completions"), list):
        raise RowError(f"{where} must be an object with a 'completions' list, got {step!r:.80}")
    completions = step["completions"]
    ratings = [_rating(c, f"{where}.completions[{i}]") for i, c in enumerate(completions)]
    chosen, human = step.get("chosen_completion"), step.get("human_completion")
    if chosen is not None:
        if isinstance(chosen, bool) or not isinstance(chosen, int) or not 0 <= chosen < len(completions):
            raise RowError(f"{where}.chosen_completion {chosen!r} is not an index into {len(completions)} completions")
        return completions[chosen]["text"], ratings[chosen]
    if human is not None:
        rating = _rating(human, f"{where}.human_completion")
        return human["text"], 1 if rating is None else rating
    if -1 in ratings:
        first_bad = ratings.index(-1)
        return completions[first_bad]["text"], -1
    return None


def prm800k_example(row: dict, *, neutral_is_good: bool = False) -> StepExample:
    """One PRM800K row: the labeller's path of steps, up to and including the first step rated -1."""
    question = _field(row, "question", dict, "an object")
    problem = _field(question, "problem", str, "a string")
    label = _field(row, "label", dict, "an object")
    raw_steps = _field(label, "steps", list, "a list")
    steps, ratings = [], []
    for index, raw in enumerate(raw_steps):
        followed = _prm800k_step(raw, index)
        if followed is None or followed[1] is None:
            break
        steps.append(followed[0])
        ratings.append(followed[1])
        if followed[1] == -1:
            break
    if not steps:
        raise RowError("no rated step on the labeller's path (label.steps)")
    labels = [rating == 1 or (rating == 0 and neutral_is_good) for rating in ratings]
    extra = {k: v for k, v in row.items() if k not in ("question", "label") and not isinstance(v, (dict, list))}
    extra.update(ratings=ratings, finish_reason=label.get("finish_reason"))
    answer = question.get("ground_truth_answer")
    return StepExample(prompt=problem, steps=steps, labels=labels, answer=None if answer is None else str(answer),
                       extra=extra)


STEPWISE_FIELDS = ("prompt", "completions", "labels", "soft_labels", "first_error", "answer")


def stepwise_example(row: dict) -> StepExample:
    """One stepwise (TRL) row."""
    prompt = _field(row, "prompt", str, "a string")
    steps = _string_list(row, "completions")
    labels = None if row.get("labels") is None else _bool_list(row["labels"], "labels", len(steps))
    soft = row.get("soft_labels")
    if soft is not None:
        numeric = isinstance(soft, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in soft)
        if not numeric or len(soft) != len(steps) or not all(0.0 <= v <= 1.0 for v in soft):
            raise RowError(f"field 'soft_labels' must be {len(steps)} numbers in [0, 1], got {soft!r:.80}")
        soft = [float(v) for v in soft]
    first_error = row.get("first_error")
    if first_error is not None:
        first_error = _first_error(first_error, "first_error", len(steps))
    if first_error is not None and labels is not None and first_error != first_error_of(labels):
        raise RowError(
            f"field 'first_error' is {first_error} but the labels' first bad step is {first_error_of(labels)}"
        )
    if TURN_STEPS_FIELD in row:  # a turn-split solution (prm.turn_steps): its tokens must hold its step ends
        try:
            TurnSteps.from_row(row[TURN_STEPS_FIELD], len(steps))
        except ValueError as error:
            raise RowError(str(error)) from None
    extra = {k: v for k, v in row.items() if k not in STEPWISE_FIELDS}
    return StepExample(prompt=prompt, steps=steps, labels=labels, soft_labels=soft, first_error=first_error,
                       answer=_optional_answer(row), extra=extra)


def processbench_example(row: dict) -> StepExample:
    """One ProcessBench row: ``first_error`` from ``label``; ``labels`` stay None (unknown past the error)."""
    problem = _field(row, "problem", str, "a string")
    steps = _string_list(row, "steps")
    first_error = _first_error(row.get("label"), "label", len(steps))
    extra = {k: v for k, v in row.items() if k not in ("problem", "steps", "label")}
    return StepExample(prompt=problem, steps=steps, first_error=first_error, extra=extra)


def synthetic_example(row: dict) -> StepExample:
    """One synthetic-task row with ground-truth labels (``prm.synthetic.example_from_synthetic_row``)."""
    try:
        return example_from_synthetic_row(row)
    except ValueError as error:
        raise RowError(str(error)) from None


ROW_READERS: dict[str, Callable[..., StepExample]] = {
    "math_shepherd": math_shepherd_example,
    "prm800k": prm800k_example,
    "stepwise": stepwise_example,
    "processbench": processbench_example,
    "synthetic": synthetic_example,
}
FORMATS = tuple(ROW_READERS)


def _options_of(reader: Callable) -> set[str]:
    return {name for name, p in inspect.signature(reader).parameters.items() if p.kind is p.KEYWORD_ONLY}


# ----------------------------------------------------------------------------- format detection
def _signatures(row: dict) -> list[str]:
    keys = set(row)
    matches = []
    if {"input", "label"} <= keys:
        matches.append("math_shepherd")
    if {"question", "label"} <= keys and isinstance(row.get("label"), dict):
        matches.append("prm800k")
    if {"prompt", "completions"} <= keys:
        matches.append("stepwise")
    if {"problem", "steps", "label"} <= keys:
        matches.append("processbench")
    # A stepwise row may carry a synthetic row's fields in its extras; "completions" marks it as stepwise.
    if {"prompt", "steps"} <= keys and keys & {"solution", "completion"} and "completions" not in keys:
        matches.append("synthetic")
    return matches


def detect_format(row: Any) -> str:
    """The format a row's keys identify (see the module docstring); ValueError when none or several match."""
    if not isinstance(row, dict):
        raise ValueError(f"cannot detect the PRM data format of a {type(row).__name__} row (expected a JSON object)")
    matches = _signatures(row)
    if len(matches) != 1:
        what = "matches no PRM data format" if not matches else f"is ambiguous between the PRM data formats {matches}"
        raise ValueError(
            f"a row with fields {sorted(row)} {what}; pass the format explicitly, one of {FORMATS} "
            "(math_shepherd: input+label, prm800k: question+label, stepwise: prompt+completions, processbench: "
            "problem+steps+label, synthetic: prompt+steps+solution|completion)"
        )
    return matches[0]


def _first_row(path: Path) -> tuple[Any, str]:
    for location, row, error in read_rows(path):
        if error is None:
            return row, location
    raise ValueError(f"{path}: no readable row to detect the format from")


def read_examples(path: str | Path, format: str, *, on_bad_row: str = "skip", **format_options) -> list[StepExample]:
    """Every usable row of ``path`` as a StepExample (``source`` = ``file:line``), in file order.

    ``format`` is one of ``FORMATS`` or ``"auto"`` (detected from the first readable row). ``format_options`` go to
    the format's reader (math_shepherd: ``tag``, ``first_step_marker``; prm800k: ``neutral_is_good``); an option no
    format knows raises, and under ``"auto"`` an option of another format than the detected one is ignored.
    """
    path = Path(path)
    bad_rows = BadRows(on_bad_row)
    known = set().union(*(_options_of(reader) for reader in ROW_READERS.values()))
    unknown = set(format_options) - known
    if unknown:
        raise ValueError(f"read_examples: unknown format options {sorted(unknown)}; known: {sorted(known)}")
    if format == "auto":
        row, location = _first_row(path)
        try:
            format = detect_format(row)
        except ValueError as error:
            raise ValueError(f"{location}: {error}") from None
        format_options = {k: v for k, v in format_options.items() if k in _options_of(ROW_READERS[format])}
    if format not in ROW_READERS:
        raise ValueError(f"unknown PRM data format {format!r}; expected one of {FORMATS} or 'auto'")
    reader = ROW_READERS[format]
    misplaced = set(format_options) - _options_of(reader)
    if misplaced:
        raise ValueError(f"read_examples: options {sorted(misplaced)} do not apply to format {format!r}")
    examples: list[StepExample] = []
    for location, row, error in read_rows(path):
        if error is None and not isinstance(row, dict):
            error = f"expected a JSON object, got {type(row).__name__}"
        if error is None:
            try:
                example = reader(row, **format_options)
            except RowError as bad:
                error = f"{format} row: {bad}"
        if error is not None:
            bad_rows.reject(location, error)
            continue
        example.source = location
        examples.append(example)
    bad_rows.finish(len(examples), str(path))
    return examples


# ----------------------------------------------------------------------------- replay
Row = TypeVar("Row")


def replay_mix(new_rows: Sequence[Row], history_rows: Sequence[Row], fraction: float, seed: int) -> list[Row]:
    """A training set of every new row plus ``round(fraction * len(history_rows))`` earlier rows drawn without
    replacement, shuffled together; deterministic in ``seed`` (DeepSeekMath's iterative RL replays 10 %)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"replay fraction must be in [0, 1], got {fraction}")
    rng = random.Random(seed)
    replayed = rng.sample(list(history_rows), round(fraction * len(history_rows)))
    mixed = [*new_rows, *replayed]
    rng.shuffle(mixed)
    return mixed


# ----------------------------------------------------------------------------- writing
def stepwise_row(example: StepExample) -> dict:
    """The stepwise (TRL) row of an example; ``extra`` fields are written beside the stepwise ones."""
    row: dict[str, Any] = {"prompt": example.prompt, "completions": list(example.steps), "labels": example.labels}
    for name in ("soft_labels", "first_error", "answer"):
        if getattr(example, name) is not None:
            row[name] = getattr(example, name)
    clash = set(example.extra) & set(STEPWISE_FIELDS)
    if clash:
        raise ValueError(f"{example.source or 'example'}: extra fields {sorted(clash)} clash with the stepwise fields")
    row.update(example.extra)
    return row


def write_stepwise(path: str | Path, examples: Iterable[StepExample]) -> Path:
    """Write examples as stepwise jsonl (one ``stepwise_row`` per line); ``read_examples(path, "stepwise")`` gives
    them back (with ``source`` set to the new ``file:line``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for example in examples:
        try:
            lines.append(json.dumps(stepwise_row(example), ensure_ascii=False))
        except TypeError as error:
            raise ValueError(f"{example.source or 'example'}: cannot write as JSON ({error})") from None
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path

