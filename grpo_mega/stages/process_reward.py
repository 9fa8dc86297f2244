"""Step rewards from a process reward model, for process-supervised GRPO (``process_reward.source: prm``).

After each rollout every completion is split into steps (``grpo_mega.data.step_split``: a regex at whose matches a
step ends; a completion without a match is one step ending at its last character, and the final answer sentence is
a step of its own with the synthetic task's pattern), the PRM scores every step of every completion in one batched
call on its own forward-only engine, and each step's score becomes its reward, ending at the step's last character
(the rollout stage maps it to the step's last response token). The guards of ``ProcessRewardConfig`` apply here,
and the answer guard (``grpo_mega.stages.answer_guard``): only the text through the first final answer is split and
scored, and a completion without one gets a final-answer step scored ``missing_answer_score`` before ``step_reward``
turns scores into rewards.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

from grpo_mega.algo import group_start_values, step_rewards_from_scores
from grpo_mega.config import ProcessRewardConfig
from grpo_mega.data.step_split import default_step_pattern, split_steps, step_char_ends
from grpo_mega.stages.answer_guard import AnswerGuard


def segment_completion(text: str, pattern: str, max_counted_steps: int = 0) -> list[str]:
    """The steps of a completion (a partition of ``text``); with ``max_counted_steps`` K > 0 the steps after the
    K-th are merged into it, so splitting an answer into many small steps earns no extra rewards."""
    steps = split_steps(text, pattern) if text.strip() else []
    if max_counted_steps and len(steps) > max_counted_steps:
        steps = steps[: max_counted_steps - 1] + ["".join(steps[max_counted_steps - 1 :])]
    return steps


def shape_step_rewards(
    scores: list[float], outcome: float, settings: ProcessRewardConfig, *, start: float = 0.0
) -> list[float]:
    """A completion's step rewards from its PRM step scores: ``few_steps_reward`` on every step when it has fewer
    than ``min_steps`` steps, else the ``step_reward`` option's rewards (``grpo_mega.algo.step_rewards``; ``start``
    is s_0 of ``progress``) times ``step_score_weight``; then the outcome score added to the last step with
    ``outcome_on_last_step``."""
    rewards = step_rewards_from_scores(scores, settings.step_reward, start=start, clip_eta=settings.clip_eta)
    rewards = [settings.step_score_weight * reward for reward in rewards]
    if settings.min_steps and len(rewards) < settings.min_steps:
        rewards = [settings.few_steps_reward] * len(rewards)
    if settings.outcome_on_last_step and rewards:
        rewards[-1] += outcome
    return rewards


class PRMScoringError(RuntimeError):
    """The PRM raised or gave a non-finite step score (``process_reward.on_error: raise``)."""


def step_reward_starts(settings: ProcessRewardConfig, prompts: Sequence[str],
                       outcomes: Sequence[float]) -> list[float]:
    """Each completion's s_0 for ``shape_step_rewards``: its group's mean outcome under ``step_reward: progress``
    (PAV), else 0."""
    if settings.step_reward == "progress":
        return group_start_values(prompts, outcomes)
    return [0.0] * len(outcomes)


def non_finite_scores(scores: Sequence[Sequence[float]]) -> dict[int, int]:
    """{completion index: index of its first NaN / Inf step score}."""
    bad = {}
    for row, row_scores in enumerate(scores):
        for step, value in enumerate(row_scores):
            if not math.isfinite(value):
                bad[row] = step
                break
    return bad


class PRMStepRewards:
    """Scores the steps of a rollout's completions with a PRM (``prm.scoring.StepScorer``); collective: every rank
    calls with the same completions and gets the same rewards."""

    def __init__(self, scorer, settings: ProcessRewardConfig, answer_guard: AnswerGuard | None = None) -> None:
        self.scorer = scorer
        self.settings = settings
        self.answer_guard = answer_guard

    def __call__(
        self, prompts: Sequence[str], texts: Sequence[str], outcomes: Sequence[float], rows_extra: Sequence[dict],
        *, completions=None,
    ) -> tuple[list[list[float]], list[list[int]], dict[str, float]]:
        """(step rewards, step ends as character offsets, metrics) of every completion (the PRM reads the texts;
        ``completions`` is the step-reward source interface's, unused here)."""
        start = time.perf_counter()
        pattern = self.settings.step_pattern or default_step_pattern(rows_extra)
        guard = self.answer_guard
        # the text through the first final answer is split and scored (all of it without an answer or a guard)
        answer_ends = [guard.answer_end(text) for text in texts] if guard is not None else [None] * len(texts)
        scored_texts = [text if end is None else text[:end] for text, end in zip(texts, answer_ends)]
        steps = [segment_completion(text, pattern, self.settings.max_counted_steps) for text in scored_texts]
        scores, failed = self._score(prompts, texts, steps)
        metrics = self._metrics(steps, scores)  # the PRM's own scores, before the guard adds a missing answer's
        ends = [step_char_ends(row_steps) for row_steps in steps]
        if guard is not None:
            guarded = [guard.guard(s, e, text, end) for s, e, text, end in zip(scores, ends, texts, answer_ends)]
            scores, ends = [s for s, _ in guarded], [e for _, e in guarded]
        starts = step_reward_starts(self.settings, prompts, outcomes)
        rewards = [shape_step_rewards(s, outcome, self.settings, start=start)
                   for s, outcome, start in zip(scores, outcomes, starts)]
        metrics["timing_s/prm"] = time.perf_counter() - start
        metrics["prm/failures"] = float(failed)
        return rewards, ends, metrics

    def _score(self, prompts: Sequence[str], texts: Sequence[str], steps: list[list[str]],
               call=None) -> tuple[list, int]:
        """The PRM's step scores and how many completions failed; a failure raises :class:`PRMScoringError`
        naming the completion, or (``on_error: zero``) scores the completion's steps 0. ``call``: what scores the
        steps (None: ``scorer.score_steps(prompts, steps)``)."""
        raise_errors = self.settings.on_error == "raise"
        try:
            found = call() if call is not None else self.scorer.score_steps(list(prompts), steps)
            scores = [list(map(float, row)) for row in found]
        except Exception as error:
            if raise_errors:
                raise PRMScoringError(f"the PRM failed on the {len(texts)} completions of this step (first prompt "
                                      f"{prompts[0][:80]!r}): {type(error).__name__}: {error}") from error
            return [[0.0] * len(row) for row in steps], len(steps)
        bad = non_finite_scores(scores)
        if bad and raise_errors:
            row, step = next(iter(bad.items()))
            raise PRMScoringError(
                f"the PRM gave a non-finite score ({scores[row][step]}) to step {step + 1} of completion {row} "
                f"(prompt {prompts[row][:80]!r}, step {steps[row][step][:80]!r}); {len(bad)} completion(s) affected; "
                "process_reward.on_error=zero scores them 0 instead")
        for row in bad:
            scores[row] = [0.0] * len(scores[row])
        return scores, len(bad)

    @staticmethod
    def _metrics(steps: list[list[str]], scores: list[list[float]]) -> dict[str, float]:
        scored = [s for s in scores if s]
        every = [value for s in scored for value in s]
        metrics = {
            "prm/steps_per_completion": sum(len(s) for s in steps) / max(len(steps), 1),
            "prm/no_step_fraction": sum(1 for s in steps if not s) / max(len(steps), 1),
        }
        if every:
            metrics.update({
                "prm/score_mean": sum(every) / len(every),
                "prm/last_step_score": sum(s[-1] for s in scored) / len(scored),
                "prm/min_step_score": sum(min(s) for s in scored) / len(scored),
            })
        return metrics


def build_prm_step_rewards(settings: ProcessRewardConfig, *, max_tokens_per_micro_batch: int,
                           engine_kind: str = "megatron", deepspeed=None,
                           answer_guard: AnswerGuard | None = None) -> PRMStepRewards:
    """Open ``settings.prm`` on a forward-only engine at the job's parallel layout (after ``init_distributed``):
    the trainer's ``engine`` (``megatron``, or ``deepspeed`` with its ``deepspeed`` settings), reading solutions as
    the PRM was trained to except where ``settings`` choose otherwise (``prm.spec.PRMChoices``)."""
    from prm.scoring import open_step_scorer
    from prm.spec import PRMChoices

    _, scorer = open_step_scorer(settings.prm, PRMChoices.of(settings),
                                 max_tokens_per_micro_batch=max_tokens_per_micro_batch, engine_kind=engine_kind,
                                 deepspeed=deepspeed)
    return PRMStepRewards(scorer, settings, answer_guard)
