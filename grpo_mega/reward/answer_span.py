"""Where a completion's first final answer ends: the point after which process supervision gives no credit.

The default locator knows the answer forms of the datasets grpo-mega reads, and takes whichever comes first in the
completion:

- "The answer is ..." or "The final answer is ..." with its capital T, as a sentence opens (the synthetic task's
  "The answer is 42.", natural-language solutions; a lower-case "the answer is" inside reasoning prose is not taken):
  the answer ends at the end of that sentence, its closing period included (a period followed by whitespace or the
  end of the text), or at the end of its line;
- LaTeX ``\\boxed{...}`` / ``\\fbox{...}`` (MATH, Qwen-Math): the answer ends at its matched closing brace;
- GSM8K's ``#### 42``: the answer ends at the end of that line.

After the end found, what closes the answer on the same line (``$``, ``$$``, ``\\]``, ``)``, a period, ``**``) is
taken into it, so "$\\boxed{4}$." ends after its period. A form that is opened but never closed (``\\boxed{4`` at
the length cap) is no answer. ``process_reward.answer_pattern`` replaces the locator with a regular expression: the
answer ends where its first match ends.
"""

from __future__ import annotations

import re
from functools import lru_cache

_ANSWER_IS = re.compile(r"The (?:final )?answer is\b")
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
_BOXED = re.compile(r"\\(?:boxed|fbox)\{")
_GSM8K = re.compile(r"####[ \t]*\S")
_CLOSERS = re.compile(r"(?:[ \t]*(?:\$\$?|\\\]|\\\)|\)|\*\*|\.(?=\s|$)))*")


def _matched_brace_end(text: str, open_brace: int) -> int | None:
    """The offset just after the ``}`` that closes the ``{`` at ``open_brace``; None when it is never closed."""
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return None


def _answer_is_end(text: str) -> tuple[int, int] | None:
    match = _ANSWER_IS.search(text)
    if match is None:
        return None
    end = _SENTENCE_END.search(text, match.end())
    return match.start(), (end.end() if end and end.group() == "." else end.start() if end else len(text))


def _boxed_end(text: str) -> tuple[int, int] | None:
    match = _BOXED.search(text)
    if match is None:
        return None
    end = _matched_brace_end(text, match.end() - 1)
    return None if end is None else (match.start(), end)


def _gsm8k_end(text: str) -> tuple[int, int] | None:
    match = _GSM8K.search(text)
    if match is None:
        return None
    newline = text.find("\n", match.end())
    return match.start(), (len(text) if newline < 0 else newline)


@lru_cache(maxsize=16)
def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"process_reward.answer_pattern {pattern!r} is not a valid regular expression: {error}") \
            from error


def final_answer_end(text: str, pattern: str | None = None) -> int | None:
    """The character offset (exclusive) where the first final answer of ``text`` ends; None when it has none.

    ``pattern`` None: the default locator (see the module docstring); else the end of the regex's first match
    (a match that ends at offset 0 is no answer)."""
    if pattern is not None:
        match = _compile(pattern).search(text)
        return match.end() if match is not None and match.end() > 0 else None
    found = [span for span in (_answer_is_end(text), _boxed_end(text), _gsm8k_end(text)) if span is not None]
    if not found:
        return None
    start, end = min(found)
    if _ANSWER_IS.match(text, start) is None:  # a boxed or #### answer: take in what closes it on its line
        end = _CLOSERS.match(text, end).end()
    return end
