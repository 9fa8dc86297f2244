"""Monte-Carlo labels of turn steps (``grpo-mega prm label --steps turns``): the policy's multi-turn tool rollouts,
each assistant turn a step (``prm.turn_steps``), each turn prefix labelled by continuations that run through the
turn loop too, tool calls included.

For a rollout with turns ``1 .. K`` and every k = 1 .. K-1 (turn k ended in a call that ran), the prefix of step k
is the rollout through the tool turn that answered turn k: the policy's own sampled tokens and the tool's output as
it was appended (a tool's output is a function of its input, so running the call again would give the same turn).
``n`` continuations of it run on through the turn loop (``TurnLoopEngine.continue_rollouts``: the prefix's turns
count towards ``max_turns`` and its tokens towards the response budget), and each whole trajectory, prefix and
continuation, is scored by the verifier as a training rollout is (its decoded response, tool turns included). The
labels are Math-Shepherd's, as for text steps (``prm.labeling.step_labels``): hard = some continuation is correct,
soft = the fraction that is; the last turn gets the rollout's own outcome.

Collective like ``prm.labeling``: every rank passes the same items and gets the same examples.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple, Sequence

from prm.examples import StepExample
from prm.labeling import LabelItem, grouped_verdicts, is_correct, plan_prefixes, step_labels
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps

if TYPE_CHECKING:
    from grpo_mega.data.prompts import PromptRecord
    from grpo_mega.reward.types import RewardFunction
    from grpo_mega.rollout.base import Completion, SamplingConfig



class TurnItem(NamedTuple):
    """One rollout to label: its text steps (``LabelItem``), the rollout itself and its turn steps."""

    item: LabelItem
    completion: Completion
    turn_steps: TurnSteps
    tool_kwargs: dict


class SampledTurnSolutions(NamedTuple):
    """The policy's rollouts split into turn steps, and how many were dropped for having no text."""

    items: list[TurnItem]
    dropped_empty: int


def turn_prefix(completion: Completion, num_steps: int) -> Completion:
    """The rollout through the tool turn that answered its ``num_steps``-th turn (1-based): the prefix whose
    continuations label step ``num_steps``. ValueError when that turn has no tool turn after it."""
    steps = [index for index, t in enumerate(completion.turns or []) if t.end > t.start]  # turns that are steps
    if not 1 <= num_steps <= len(steps):
        raise ValueError(f"the rollout has {len(steps)} turn steps, no step {num_steps}")
    turn = completion.turns[steps[num_steps - 1]]
    if turn.tool_end is None:
        raise ValueError(f"turn {num_steps} of the rollout ended {turn.ended!r} with no tool turn after it: no "
                         "continuation can follow it")
    cut = turn.tool_end
    return dataclasses.replace(
        completion, response_ids=completion.response_ids[:cut], response_logprobs=completion.response_logprobs[:cut],
        response_mask=completion.policy_mask[:cut], turns=completion.turns[:steps[num_steps - 1] + 1],
        finish_reason="stop")


def sample_turn_solutions(
    loop, tokenizer, records: Sequence[PromptRecord], *, samples_per_prompt: int, sampling: SamplingConfig,
    seed: int, tool_kwargs: Sequence[dict] | None = None,
) -> SampledTurnSolutions:
    """``samples_per_prompt`` multi-turn rollouts per record through ``loop`` (a ``TurnLoopEngine``; collective),
    each split into turn steps; a rollout with no text is dropped and counted. ``tool_kwargs[p]``: record p's
    per-tool keyword arguments (``grpo_mega.stages.rollout.row_tool_kwargs`` of its row; none by default)."""
    from grpo_mega.rollout.distributed import generate_across_ranks

    if samples_per_prompt < 1:
        raise ValueError(f"sample_turn_solutions: samples_per_prompt must be >= 1, got {samples_per_prompt}")
    kwargs = list(tool_kwargs) if tool_kwargs is not None else [{} for _ in records]
    completions = generate_across_ranks(loop, [r.prompt_ids for r in records],
                                        dataclasses.replace(sampling, n=samples_per_prompt, seed=seed),
                                        call_seed=seed, tool_kwargs=kwargs)
    items, dropped = [], 0
    for position, completion in enumerate(completions):
        record = records[position // samples_per_prompt]
        if not completion.text.strip():
            dropped += 1
            continue
        steps = TurnSteps.of(completion)
        item = LabelItem(prompt=record.prompt, prompt_ids=list(record.prompt_ids), steps=steps.texts(tokenizer),
                         answer=record.answer, extra=dict(record.extra),
                         source=f"{record.source}#{position % samples_per_prompt}")
        items.append(TurnItem(item, completion, steps, kwargs[position // samples_per_prompt]))
    return SampledTurnSolutions(items, dropped)


def monte_carlo_turn_labels(
    loop, items: Sequence[TurnItem], *, n: int, sampling: SamplingConfig, reward_fn: RewardFunction, seed: int,
    on_error: str = "raise",
) -> list[StepExample]:
    """A :class:`StepExample` per rollout with Monte-Carlo hard and soft labels of its turns (module docstring);
    its ``extra`` holds ``outcome`` (the rollout's verifier score) and ``turn_steps`` (``TurnSteps.to_row``).
    ``sampling`` gives temperature, top-p/k and stop strings; its ``n`` and ``seed`` are replaced."""
    from grpo_mega.reward.distributed import score_across_ranks
    from grpo_mega.rollout.distributed import generate_across_ranks

    if n < 1:
        raise ValueError(f"monte_carlo_turn_labels: n must be >= 1, got {n}")
    step_counts = [len(t.turn_steps.step_ends) for t in items]
    prefixes = plan_prefixes(step_counts)
    continued: list[Completion] = []
    if prefixes:
        cut = [turn_prefix(items[p.item].completion, p.num_steps) for p in prefixes]
        continued = generate_across_ranks(
            _Continuing(loop, cut), [c.prompt_ids + c.response_ids for c in cut],
            dataclasses.replace(sampling, n=n, seed=seed), call_seed=seed,
            tool_kwargs=[items[p.item].tool_kwargs for p in prefixes])
    owners = [items[p.item].item for p in prefixes for _ in range(n)] + [t.item for t in items]
    solutions = [c.text for c in continued] + [t.completion.text for t in items]
    results = score_across_ranks(reward_fn, [o.prompt for o in owners], solutions, [o.answer for o in owners],
                                 [o.extra for o in owners], on_error=on_error)
    grouped, outcomes = grouped_verdicts(results, prefixes, n, step_counts)
    examples = []
    for turn_item, rollouts, outcome in zip(items, grouped, outcomes):
        item = turn_item.item
        hard, soft = step_labels(rollouts, is_correct(outcome))
        examples.append(StepExample(prompt=item.prompt, steps=list(item.steps), labels=hard, soft_labels=soft,
                                    answer=item.answer, source=item.source,
                                    extra={"outcome": outcome, TURN_STEPS_FIELD: turn_item.turn_steps.to_row()}))
    return examples


class _Continuing:
    """The engine ``generate_across_ranks`` drives for continuations: given a prefix's tokens (prompt and response
    through its tool turn) as a prompt, its ``generate`` is the loop's ``continue_rollouts`` of that prefix
    (identical tokens are one rollout: the same turns and tool turns); replica layout and the rest: the loop's."""

    def __init__(self, loop, prefixes: Sequence[Completion]):
        self.loop = loop
        self.prefixes = {tuple(p.prompt_ids + p.response_ids): p for p in prefixes}

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loop"], name)

    def generate(self, prompt_ids, sampling, tool_kwargs=None):
        return self.loop.continue_rollouts([self.prefixes[tuple(ids)] for ids in prompt_ids], sampling, tool_kwargs)
