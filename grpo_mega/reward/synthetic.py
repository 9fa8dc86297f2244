"""Outcome reward of the synthetic arithmetic task (``grpo_mega.data.synthetic``)."""

from __future__ import annotations

from grpo_mega.data.synthetic import parse_solution


def synthetic_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """1.0 if the completion's "The answer is N" equals the gold answer, else 0.0 (also when it has no answer).

    Raises ValueError when the gold ``answer`` is not an integer: that is a dataset error, not a wrong completion.
    """
    try:
        gold = int(str(answer).strip())
    except ValueError as error:
        raise ValueError(f"synthetic_reward: gold answer {answer!r} is not an integer") from error
    return 1.0 if parse_solution(completion).answer == gold else 0.0
