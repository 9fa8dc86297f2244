"""Format rewards: does a completion follow the answer layout a task requires (not whether it is right)."""

from __future__ import annotations

import re

from grpo_mega.reward.math_answer import extract_boxed

# " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36." with steps numbered 1, 2, ... in order.
_STEP = r"Step (\d+): -?\d+ [+\-*] -?\d+ = -?\d+\."
_STEP_SOLUTION = re.compile(rf"\s*(?:{_STEP}\s*)+The answer is -?\d+\.\s*")
_STEP_NUMBER = re.compile(_STEP)


def follows_step_format(completion: str) -> bool:
    """Whether the completion is exactly a synthetic-task solution: numbered equation steps, then the answer."""
    if _STEP_SOLUTION.fullmatch(completion) is None:
        return False
    numbers = [int(n) for n in _STEP_NUMBER.findall(completion)]
    return numbers == list(range(1, len(numbers) + 1))


def step_format_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """1.0 if the completion follows the synthetic task's step format (``follows_step_format``), else 0.0."""
    return 1.0 if follows_step_format(completion) else 0.0


def boxed_format_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """1.0 if the completion has exactly one ``\\boxed{...}`` with balanced braces and non-empty content, else 0.0."""
    if completion.count("\\boxed{") != 1:
        return 0.0
    content = extract_boxed(completion)
    return 1.0 if content is not None and content.strip() else 0.0
