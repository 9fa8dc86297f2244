"""Final-answer verification for math datasets: GSM8K "#### 42" golds, LaTeX ``\\boxed{}`` answers, plain numbers.

Symbolic equivalence (``\\frac{1}{2}`` vs ``0.5``, ``\\sqrt 2`` vs ``\\sqrt{2}``) is math-verify's job; this module
only prepares its inputs and falls back to comparing plain numbers when math-verify finds nothing to compare.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_GSM8K_MARKER = "####"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None  # unbalanced braces: no complete answer


def extract_gold_answer(answer: str) -> str:
    """The answer part of a gold label: text after GSM8K's ``####``, the last ``\\boxed{}``, or the whole label."""
    if _GSM8K_MARKER in answer:
        return answer.rsplit(_GSM8K_MARKER, 1)[1].strip()
    boxed = extract_boxed(answer)
    return (boxed if boxed is not None else answer).strip()


def extract_predicted_answer(completion: str) -> str | None:
    """The answer a completion commits to: after its last ``####``, else its last ``\\boxed{}``; None otherwise."""
    if _GSM8K_MARKER in completion:
        tail = completion.rsplit(_GSM8K_MARKER, 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    return extract_boxed(completion)


def parse_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact Fraction ("1,000" -> 1000, "3/4", "-0.5"); None if there is none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return Fraction(matches[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify_equal(gold: str, predicted: str) -> bool | None:
    """math-verify's verdict, or None when it extracts nothing from one side.

    math-verify bounds its work with ``signal.alarm``, which only works in the main thread; elsewhere the timeouts
    are switched off (its documented way to run in threads).
    """
    from math_verify import parse, verify

    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main_thread else None
    parsed_gold = parse(gold, parsing_timeout=timeout)
    if not parsed_gold and "\\" in gold:
        # Bare LaTeX such as "\sqrt{2}" needs math delimiters; plain text must not get them, or its words would be
        # read as products of symbols ("about 7" -> a*b*o*u*t*7).
        parsed_gold = parse(f"${gold}$", parsing_timeout=timeout)
    parsed_predicted = parse(predicted, parsing_timeout=timeout)
    if not parsed_gold or not parsed_predicted:
        return None
    return bool(verify(parsed_gold, parsed_predicted, timeout_seconds=timeout))


def answers_match(gold_answer: str, completion: str) -> bool:
    """Whether ``completion``'s final answer equals the gold answer (``#### x``, ``\\boxed{x}`` or plain ``x``).

    Order: math-verify on the completion's committed answer (after ``####`` / in ``\\boxed{}``, else the whole
    completion); if math-verify extracts nothing, exact comparison of the last plain numbers on both sides.
    """
    gold = extract_gold_answer(gold_answer)
    predicted = extract_predicted_answer(completion)
    candidate = predicted if predicted is not None else completion
    verdict = _math_verify_equal(gold, f"\\boxed{{{predicted}}}" if predicted is not None else completion)
    if verdict is not None:
        return verdict
    gold_number, predicted_number = parse_number(gold), parse_number(candidate)
    return gold_number is not None and gold_number == predicted_number


def math_verify_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """1.0 if the completion's final answer is mathematically equal to the gold ``answer``, else 0.0."""
    return 1.0 if answers_match(answer, completion) else 0.0
