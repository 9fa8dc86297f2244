"""The tool task's per-turn oracle (``reward.function: tool_task_turns``): the ground truth of each assistant turn of
a calculator trajectory (``grpo_mega.data.tool_task``), as ``synthetic_steps`` is the ground truth of each text step.

A turn is right (reward 1.0, else 0.0) when everything it does is right:

- every "Step N: lhs op rhs = result" whose text ends inside the turn is correct (``check_steps``: the problem's
  own N-th operation on the true carried value, the arithmetic right);
- every calculator call it makes ran without error and computes the chain's next operation: the problem's
  (s + 1)-th operation on the true carried value, s the steps written up to the call (``a + b`` and ``a * b``
  accepted either way round);
- the final answer, if the turn states it, is the gold answer;
- it does one of these things (a void turn, one with no step, no call and no answer, is not right).

The outcome ``score`` is ``synthetic``'s: the first "The answer is N" of the whole trajectory equals the gold answer.
"""

from __future__ import annotations

import re

from grpo_mega.data.synthetic import Problem, StepVerdict, check_steps, parse_solution
from grpo_mega.data.tool_task import CALCULATOR
from grpo_mega.reward.synthetic import synthetic_reward
from grpo_mega.reward.types import TurnRewards

_EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def _is_next_operation(call: dict, problem: Problem, done: int) -> bool:
    """Whether ``call`` ran the calculator, without error, on the problem's operation ``done + 1`` (1-based)."""
    if call.get("name") != CALCULATOR or call.get("error") or done >= len(problem.steps):
        return False
    match = _EXPRESSION.match(str((call.get("arguments") or {}).get("expression", "")))
    if match is None:
        return False
    lhs, op, rhs = int(match.group(1)), match.group(2), int(match.group(3))
    want = problem.steps[done]
    if op != want.op:
        return False
    return (lhs, rhs) == (want.lhs, want.rhs) or (op in "+*" and (lhs, rhs) == (want.rhs, want.lhs))


def tool_task_turn_reward(prompt: str, completion: str, answer: str, *, steps=None, turns=None,
                          **extra) -> TurnRewards | float:
    """Per-turn ground truth of a tool-task trajectory (see the module docstring). Needs the row's ``steps`` (a
    synthetic task row) and ``turns``, the trainer's view of the trajectory's assistant turns
    (``grpo_mega.stages.turn_steps.turn_views``: each turn's character span ``start`` / ``end`` in ``completion``,
    its ``ended`` reason and its ``calls``). Called without ``turns`` (the held-out evaluation, outcome
    supervision) it is the outcome verifier: ``synthetic``'s score."""
    if turns is None:
        return synthetic_reward(prompt, completion, answer)
    if steps is None:
        raise ValueError("tool_task_turns needs the dataset row's 'steps' field (a tool-task row)")
    problem = Problem.from_record({"steps": steps})
    parsed = parse_solution(completion)
    verdicts = check_steps(problem, completion)
    score = synthetic_reward(prompt, completion, answer)
    rewards = []
    for turn in turns:
        start, end = turn["start"], turn["end"]
        inside = [v for s, v in zip(parsed.steps, verdicts) if start < s.end <= end]
        written_before = sum(1 for s in parsed.steps if s.end <= end)
        answered_here = parsed.answer_end is not None and start < parsed.answer_end <= end
        calls = turn.get("calls") or []
        right = all(v is StepVerdict.CORRECT for v in inside)
        right = right and all(_is_next_operation(call, problem, written_before) for call in calls)
        right = right and (not answered_here or score == 1.0)
        right = right and bool(inside or calls or answered_here)
        rewards.append(1.0 if right else 0.0)
    return TurnRewards(score=score, turn_rewards=rewards)
