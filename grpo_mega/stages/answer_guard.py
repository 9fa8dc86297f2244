"""The answer guard of process supervision on a rollout's completions (``algorithm.answer_guard``; the rules and why
are ``grpo_mega.algo.answer_credit``'s): steps cut at the first final answer (found by
``grpo_mega.reward.answer_span``), a missing answer scored as a wrong one. Character offsets throughout; the
rollout stage maps them to tokens afterwards."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from grpo_mega.algo import cut_at_answer
from grpo_mega.reward.answer_span import final_answer_end
from grpo_mega.reward.types import SampleReward


class AnswerGuard:
    """Where each completion's final answer ends, and its steps with the guard's rules."""

    def __init__(self, answer_pattern: str | None = None, missing_answer_score: float = 0.0) -> None:
        self.answer_pattern = answer_pattern
        self.missing_answer_score = float(missing_answer_score)

    def answer_end(self, text: str) -> int | None:
        return final_answer_end(text, self.answer_pattern)

    def guard(self, values: Sequence[float], ends: Sequence[int], text: str,
              answer_end: int | None) -> tuple[list[float], list[int]]:
        """``text``'s step ``values`` and character ``ends`` cut at its final answer's end ``answer_end``
        (:meth:`answer_end`); with none, a missing-answer step of ``missing_answer_score`` after the text (its end
        one past the text, so that it lands on the token after the text: the end-of-sequence token of a finished
        completion)."""
        return cut_at_answer(values, ends, answer_end, missing_value=self.missing_answer_score,
                             missing_end=len(text) + 1)

    def guard_reward(self, result: SampleReward, text: str) -> SampleReward:
        """A reward function's step rewards (``source: function``) with the guard's rules; a failed sample or one
        without step rewards unchanged."""
        if result.failed or result.step_rewards is None:
            return result
        rewards, ends = self.guard(result.step_rewards, result.step_ends, text, self.answer_end(text))
        return dataclasses.replace(result, step_rewards=rewards, step_ends=ends)


def answer_guard_of(cfg) -> AnswerGuard | None:
    """The guard a GRPO config asks for: process supervision with ``algorithm.answer_guard``; else None."""
    if cfg.algorithm.supervision != "process" or not cfg.algorithm.answer_guard:
        return None
    return AnswerGuard(cfg.process_reward.answer_pattern, cfg.process_reward.missing_answer_score)
