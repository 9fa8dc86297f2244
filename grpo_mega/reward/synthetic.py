"""Rewards of the synthetic arithmetic task (``grpo_mega.data.synthetic``): the outcome verifier, and the
ground-truth step checker (an "oracle PRM": the step rewards a perfect process reward model would give)."""

from __future__ import annotations

from grpo_mega.data.synthetic import Problem, check_steps, parse_solution, StepVerdict
from grpo_mega.reward.types import StepRewards


def _gold(answer: str) -> int:
    try:
        return int(str(answer).strip())
    except ValueError as error:
        raise ValueError(f"synthetic reward: gold answer {answer!r} is not an integer") from error


def synthetic_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """1.0 if the completion's "The answer is N" equals the gold answer, else 0.0 (also when it has no answer).

    Raises ValueError when the gold ``answer`` is not an integer: that is a dataset error, not a wrong completion.
    """
    return 1.0 if parse_solution(completion).answer == _gold(answer) else 0.0


def synthetic_step_reward(prompt: str, completion: str, answer: str, **extra) -> StepRewards:
    """Ground-truth step rewards: 1.0 for a step that is right and consistent with the problem
    (``check_steps``), else 0.0; the answer sentence is the last step, rewarded 1.0 when the answer is right.

    A completion with neither steps nor an answer sentence is one step ending at its last character (reward 0).
    ``score`` is the outcome reward (:func:`synthetic_reward`). Needs the row's ``steps`` field.
    """
    if "steps" not in extra:
        raise ValueError("synthetic_step_reward needs the dataset row's 'steps' field (a synthetic task row)")
    problem = Problem.from_record({"steps": extra["steps"]})
    parsed = parse_solution(completion)
    score = 1.0 if parsed.answer == _gold(answer) else 0.0
    rewards = [1.0 if v is StepVerdict.CORRECT else 0.0 for v in check_steps(problem, completion)]
    ends = [step.end for step in parsed.steps]
    if parsed.answer_end is not None:
        rewards.append(score)
        ends.append(parsed.answer_end)
    if not ends and completion:
        rewards, ends = [0.0], [len(completion)]
    return StepRewards(score=score, step_rewards=rewards, step_ends=ends)
