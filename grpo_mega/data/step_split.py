"""Splitting a solution text into reasoning steps with a regular expression.

Used by the PRM (``prm/``: its examples are (prompt, steps)) and by the policy trainer's process supervision (a
step's reward lands on the token where the step ends). The rule, one for both:

- A step ends where a match of ``pattern`` ends, so a separator (``"\\n\\n"``) stays with the step before it. A
  zero-width lookahead match (``(?=Step \\d+:)``) cuts at its position, so the text it looks at starts the next step.
- No step is empty or whitespace only: a whitespace-only piece is joined to a neighbour. The neighbour is the next
  step when the piece starts at a zero-width cut or at the start of the text (the whitespace a lookahead
  ``(?=\\s*Step)`` looks past belongs to the step it introduces, and a lookahead matches at every position of that
  whitespace), else the previous step (a separator followed by more whitespace ends the same step).
- ``"".join(split_steps(text, pattern)) == text`` always; a text without any match is one step; "" gives [].
"""

from __future__ import annotations

import re
from functools import lru_cache

SYNTHETIC_STEP_PATTERN = r"(?=\s*Step \d+:)|(?=\s*The answer is)"
"""Steps of the synthetic arithmetic task: each "Step k:" sentence and the final "The answer is N." sentence."""
DOUBLE_NEWLINE_PATTERN = r"\n\n"
"""Steps separated by a blank line, as most chat models write them (the usual PRM800K / Qwen-PRM convention)."""


@lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"step pattern {pattern!r} is not a valid regular expression: {error}") from error


def split_steps(text: str, pattern: str) -> list[str]:
    """The steps of ``text``: pieces ending where matches of the regex ``pattern`` end (see the module docstring)."""
    regex = _compile(pattern)
    # (position, cut made by a zero-width match); position 0 counts as zero-width: leading whitespace goes forward.
    cuts: dict[int, bool] = {0: True}
    for match in regex.finditer(text):
        position = match.end()
        if 0 < position < len(text):
            cuts[position] = cuts.get(position, False) or match.start() == match.end()
    positions = sorted(cuts)
    steps: list[str] = []
    pending = ""  # whitespace waiting to be prefixed to the next step
    for start, end in zip(positions, positions[1:] + [len(text)]):
        piece = text[start:end]
        if not piece:
            continue
        if piece.isspace():
            if cuts[start] or not steps:
                pending += piece
            else:
                steps[-1] += piece
            continue
        steps.append(pending + piece)
        pending = ""
    if pending:
        if steps:
            steps[-1] += pending
        else:
            steps.append(pending)  # the whole text is whitespace: one step, so the join still gives the text
    return steps


def step_char_ends(steps: list[str]) -> list[int]:
    """Exclusive character offset where each step ends in ``"".join(steps)`` (cumulative lengths)."""
    ends, total = [], 0
    for step in steps:
        total += len(step)
        ends.append(total)
    return ends


def default_step_pattern(rows_extra) -> str:
    """``SYNTHETIC_STEP_PATTERN`` when every dataset row carries the synthetic task's ``steps`` record (``rows_extra``:
    the rows' extra fields, e.g. ``PromptRecord.extra``), else a blank line (``DOUBLE_NEWLINE_PATTERN``)."""
    rows_extra = list(rows_extra)
    synthetic = bool(rows_extra) and all("steps" in extra for extra in rows_extra)
    return SYNTHETIC_STEP_PATTERN if synthetic else DOUBLE_NEWLINE_PATTERN
