"""Per-turn rewards of multi-turn rollouts (``process_reward.steps: turns``) from the sources that are not the reward
function: the tools' own verdicts (``source: tool``) and a learned PRM (``source: prm``). Each is a step-reward source
of the rollout stage (``grpo_mega.stages.step_sources``), called as ``(prompts, texts, outcome scores, rows' extra
fields, completions=...)`` and returning ``(rewards per turn step, step ends as response token indices, metrics)``
for every completion; the steps are ``grpo_mega.stages.turn_steps``'."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from grpo_mega.config import ProcessRewardConfig
from grpo_mega.rollout.base import Completion
from grpo_mega.stages.process_reward import PRMStepRewards, shape_step_rewards, step_reward_starts
from grpo_mega.stages.turn_steps import step_turns, turn_step_ends, turn_step_texts


def tool_turn_reward(turn, settings: ProcessRewardConfig) -> float:
    """A turn's reward from its tools: the mean over its calls of each call's reward (the tool's own where it gave
    one, ``tool_error_reward`` for a failed call, else ``tool_success_reward``); ``tool_void_turn_reward`` for a void
    turn; 0 for any other turn without a call (the answer, a turn cut at its limit: the outcome judges them)."""
    if not turn.calls:
        return settings.tool_void_turn_reward if turn.ended == "void" else 0.0
    values = [settings.tool_error_reward if call.error else
              (float(call.reward) if call.reward is not None else settings.tool_success_reward)
              for call in turn.calls]
    return sum(values) / len(values)


def score_turn_steps(scorer, completions: Sequence[Completion]) -> list[list[float]]:
    """``scorer.score_turn_steps`` over the completions' turn steps (``prm.turn_steps.TurnSteps.of``) in one call;
    a completion without a step (no assistant turn with a model token) is not sent and gets no score, as the text
    path gives it none."""
    from prm.turn_steps import TurnSteps

    has_steps = [bool(step_turns(c)) for c in completions]
    steps = [TurnSteps.of(c) for c, keep in zip(completions, has_steps) if keep]
    scored = iter(scorer.score_turn_steps(steps) if steps else [])
    return [list(next(scored)) if keep else [] for keep in has_steps]


class ToolTurnRewards:
    """``process_reward.source: tool``: each turn scored by its tool calls (:func:`tool_turn_reward`)."""

    def __init__(self, settings: ProcessRewardConfig) -> None:
        self.settings = settings

    def __call__(self, prompts: Sequence[str], texts: Sequence[str], outcomes: Sequence[float],
                 rows_extra: Sequence[dict], *, completions: Sequence[Completion]):
        rewards = [[tool_turn_reward(turn, self.settings) for turn in step_turns(c)] for c in completions]
        calls = [call for c in completions for turn in step_turns(c) for call in turn.calls]
        metrics = {"turn_reward/tool_error_call_fraction": sum(bool(c.error) for c in calls) / max(len(calls), 1),
                   "turn_reward/tool_own_reward_fraction":
                       sum(c.reward is not None and not c.error for c in calls) / max(len(calls), 1)}
        return rewards, [turn_step_ends(c) for c in completions], metrics


class PRMTurnRewards:
    """``process_reward.source: prm`` with turns: the PRM scores every turn step of every completion in one batched
    call (each step read at its last model token, the earlier tool outputs in its context), the scores shaped by
    ``process_reward.step_reward`` as text steps are (``shape_step_rewards``). A scorer that reads turn steps from
    the policy's own tokens (``score_turn_steps`` of ``grpo-mega prm``'s turn rendering, as a PRM trained on
    turn-split rows was) is given the rollouts' tokens; any other scorer the steps' texts (``turn_step_texts``,
    re-encoded by the PRM's tokenizer). No final-answer step is added: turn credit anchors a missing answer's
    outcome instead (``algorithm.wrong_answer_reward``)."""

    def __init__(self, scorer, settings: ProcessRewardConfig, decode: Callable[[list[int]], str]) -> None:
        self.prm = PRMStepRewards(scorer, settings)  # its scoring call and on_error handling
        self.settings, self.decode = settings, decode

    def __call__(self, prompts: Sequence[str], texts: Sequence[str], outcomes: Sequence[float],
                 rows_extra: Sequence[dict], *, completions: Sequence[Completion]):
        start = time.perf_counter()
        steps = [turn_step_texts(c, self.decode) for c in completions]
        call = None
        if hasattr(self.prm.scorer, "score_turn_steps"):  # the policy's tokens, as prm/turn_rendering.py renders them
            call = lambda: score_turn_steps(self.prm.scorer, completions)  # noqa: E731
        scores, failed = self.prm._score(prompts, texts, steps, call=call)
        metrics = PRMStepRewards._metrics(steps, scores)
        starts = step_reward_starts(self.settings, prompts, outcomes)
        rewards = [shape_step_rewards(s, outcome, self.settings, start=s0)
                   for s, outcome, s0 in zip(scores, outcomes, starts)]
        metrics["timing_s/prm"] = time.perf_counter() - start
        metrics["prm/failures"] = float(failed)
        return rewards, [turn_step_ends(c) for c in completions], metrics
