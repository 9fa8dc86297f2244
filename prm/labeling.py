"""Monte-Carlo step labels (Math-Shepherd) from a policy's rollout engine; the command ``grpo-mega prm label`` is
``prm.label_command``, the policy it samples from ``prm.policy``.

A step is good when the policy can still reach the right answer from it. For a solution with steps
``s_1 .. s_K`` of a prompt, every prefix ``s_1 .. s_k`` (k = 1 .. K-1) gets ``n`` sampled continuations; each
full solution ``s_1 .. s_k + continuation`` is scored by the task's verifier (score > 0.5 counts as correct):

- hard label of step k: at least one of the n continuations is correct (Math-Shepherd's "hard estimation");
- soft label of step k: the fraction of the n continuations that are correct ("soft estimation");
- the last step (the finished solution) is labelled by the solution's own outcome, without sampling (soft 0/1).

Every prefix of every solution goes into one batched generation (``generate_across_ranks``: the ranks split the
prompts and all of them get every continuation) and one scoring call (``score_across_ranks``), so the labels are
the same on every rank and depend only on the seed and the number of ranks.

Prefix tokens: the prompt's ids as the dataset gives them (``load_prompt_dataset``) followed by
``tokenizer(prefix_text, add_special_tokens=False)``, the canonical tokenization of the prefix text. Caveat: it
can differ from the ids the policy sampled, (a) when a step boundary falls inside what BPE merges into one token,
so the prefix ends on a token the policy would not have stopped at, and (b) when the policy sampled a
non-canonical split of its own text. Both default step patterns cut where byte-level BPE with Qwen2 / Llama-3
pre-tokenization starts a new pre-token (before " Step k:" / " The answer is", after a blank line), so (a) does
not arise there; (b) is rare for a policy trained on canonical tokenizations, like the quickstart's SFT policy.

What the labels measure: whether *this policy* can finish the solution from the step, not whether the step is
right. A weak completer gives false negatives (a right step from which none of the n continuations reaches the
answer); a policy whose final answer does not follow its steps gives false positives (a wrong step followed by a
lucky answer). More continuations trade the first for the second.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from grpo_mega.data.step_split import split_steps
from prm.examples import StepExample

if TYPE_CHECKING:
    from grpo_mega.data.prompts import PromptRecord
    from grpo_mega.reward.types import RewardFunction
    from grpo_mega.rollout.base import SamplingConfig

# The distributed helpers are imported where they are used: every `grpo-mega` command builds the parser with the
# flags of prm.label_command, which imports this module, also the launcher process that only execs torchrun.

logger = logging.getLogger(__name__)

CORRECT_ABOVE = 0.5
"""A verifier score above this counts as a correct solution (0/1 verifiers: score 1)."""


@dataclass(frozen=True)
class LabelItem:
    """One solution to label: the prompt as the policy saw it, the solution's steps, and what the verifier needs."""

    prompt: str
    """The formatted prompt text (``PromptRecord.prompt``); the solution is written right after it."""
    prompt_ids: list[int]
    """The prompt's token ids as the policy was given them (``PromptRecord.prompt_ids``)."""
    steps: list[str]
    """The solution's steps; ``"".join(steps)`` is the solution text."""
    answer: str | None
    """The gold answer passed to the verifier."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The dataset row's other fields, passed to the verifier (e.g. the synthetic task's ``steps``)."""
    source: str = ""
    """Where the item came from, e.g. ``train.jsonl:12#1`` (row 12, policy sample 1)."""


class Prefix(NamedTuple):
    """The first ``num_steps`` steps of item ``item``: one prompt of the Monte-Carlo generation."""

    item: int
    num_steps: int


# ----------------------------------------------------------------------------- pure label arithmetic
def is_correct(score: float) -> bool:
    """Whether a verifier score counts as a correct solution."""
    return score > CORRECT_ABOVE


def plan_prefixes(step_counts: Sequence[int]) -> list[Prefix]:
    """The prefixes to continue: ``(item, k)`` for k = 1 .. K-1 of every item with K steps (the last step is
    labelled by the outcome). Ordered by the number of steps still to write, most first, so a generation chunk
    holds continuations of similar length (a chunk runs until its longest row ends)."""
    prefixes = [Prefix(item, k) for item, count in enumerate(step_counts) for k in range(1, count)]
    return sorted(prefixes, key=lambda p: step_counts[p.item] - p.num_steps, reverse=True)


def group_rollouts(
    prefixes: Sequence[Prefix], correct: Sequence[bool], n: int, step_counts: Sequence[int]
) -> list[list[list[bool]]]:
    """Regroup the flat correctness of the continuations (``n`` per prefix, in ``prefixes`` order) by item and
    step: ``result[item][k - 1]`` holds the n outcomes of the continuations of prefix k."""
    if len(correct) != n * len(prefixes):
        raise ValueError(f"group_rollouts: {len(correct)} outcomes for {len(prefixes)} prefixes x n={n}")
    grouped: list[list[list[bool] | None]] = [[None] * max(count - 1, 0) for count in step_counts]
    for position, prefix in enumerate(prefixes):
        if not 1 <= prefix.num_steps < step_counts[prefix.item]:
            raise ValueError(f"group_rollouts: prefix {prefix} outside 1..{step_counts[prefix.item] - 1} steps")
        grouped[prefix.item][prefix.num_steps - 1] = list(correct[position * n : (position + 1) * n])
    for item, rows in enumerate(grouped):
        missing = [k + 1 for k, row in enumerate(rows) if row is None]
        if missing:
            raise ValueError(f"group_rollouts: item {item} has no continuations for prefixes {missing}")
    return grouped  # type: ignore[return-value]


def step_labels(rollouts: Sequence[Sequence[bool]], outcome: bool) -> tuple[list[bool], list[float]]:
    """(hard, soft) labels of a solution's steps from its prefixes' continuation outcomes.

    ``rollouts[k - 1]``: whether each continuation of the first k steps was correct, for k = 1 .. K-1.
    Hard label = any continuation correct, soft = fraction correct; the last step gets the solution's ``outcome``.
    """
    for k, outcomes in enumerate(rollouts, start=1):
        if not outcomes:
            raise ValueError(f"step_labels: prefix {k} has no continuations")
    hard = [any(outcomes) for outcomes in rollouts] + [bool(outcome)]
    soft = [sum(outcomes) / len(outcomes) for outcomes in rollouts] + [1.0 if outcome else 0.0]
    return hard, soft


# ----------------------------------------------------------------------------- generation and scoring
def prefix_token_ids(tokenizer, item: LabelItem, num_steps: int) -> list[int]:
    """The policy's input for a prefix: the prompt's ids + ``tokenizer(steps[:num_steps] joined)`` (no special
    tokens; see the module docstring for the BPE-boundary caveat)."""
    text = "".join(item.steps[:num_steps])
    return list(item.prompt_ids) + list(tokenizer(text, add_special_tokens=False)["input_ids"])


def monte_carlo_labels(
    engine,
    tokenizer,
    items: Sequence[LabelItem],
    *,
    n: int,
    sampling: SamplingConfig,
    reward_fn: RewardFunction,
    seed: int,
    on_error: str = "raise",
) -> list[StepExample]:
    """A :class:`StepExample` per item with Monte-Carlo hard and soft labels (see the module docstring).

    Collective when distributed (every rank passes the same items and gets the same examples). ``sampling``
    gives temperature, top-p/k, max_new_tokens and stop strings of the continuations; its ``n`` and ``seed``
    are replaced by ``n`` and ``seed``. ``on_error``: a verifier failure raises (``"raise"``, naming the sample)
    or counts as incorrect (``"zero"``, logged). ``extra["outcome"]`` of an example is its solution's verifier score.
    """
    from grpo_mega.reward.distributed import score_across_ranks
    from grpo_mega.rollout.distributed import generate_across_ranks

    if n < 1:
        raise ValueError(f"monte_carlo_labels: n must be >= 1, got {n}")
    for index, item in enumerate(items):
        if not item.steps:
            raise ValueError(f"monte_carlo_labels: item {index} ({item.source or 'no source'}) has no steps")
    step_counts = [len(item.steps) for item in items]
    prefixes = plan_prefixes(step_counts)
    continuation_texts: list[str] = []
    if prefixes:
        prompt_ids = [prefix_token_ids(tokenizer, items[p.item], p.num_steps) for p in prefixes]
        completions = generate_across_ranks(
            engine, prompt_ids, dataclasses.replace(sampling, n=n, seed=seed), call_seed=seed
        )
        continuation_texts = [completion.text for completion in completions]
    # One scoring call: every continued solution (prefix + continuation), then every finished solution.
    owners = [items[p.item] for p in prefixes for _ in range(n)]
    solutions = [
        "".join(items[p.item].steps[: p.num_steps]) + continuation_texts[position * n + j]
        for position, p in enumerate(prefixes)
        for j in range(n)
    ]
    owners += list(items)
    solutions += ["".join(item.steps) for item in items]
    results = score_across_ranks(
        reward_fn, [o.prompt for o in owners], solutions, [o.answer for o in owners], [o.extra for o in owners],
        on_error=on_error,
    )
    grouped, outcomes = grouped_verdicts(results, prefixes, n, step_counts)
    examples = []
    for item, rollouts, outcome in zip(items, grouped, outcomes):
        hard, soft = step_labels(rollouts, is_correct(outcome))
        examples.append(StepExample(prompt=item.prompt, steps=list(item.steps), labels=hard, soft_labels=soft,
                                    answer=item.answer, source=item.source, extra={"outcome": outcome}))
    return examples


def grouped_verdicts(results, prefixes, n: int, step_counts: list[int]):
    """The verifier's ``results`` of one labelling call (the ``n`` continuations of every prefix, then every finished
    solution) as (each solution's continuations' correctness per step, ``group_rollouts``; each solution's own
    outcome score); failed calls count as incorrect, with one warning."""
    failures = [r for r in results if r.failed]
    if failures:
        logger.warning("%d of %d verifier calls failed and count as incorrect; first: %s", len(failures),
                       len(results), failures[0].error)
    rollout_correct = [is_correct(r.score) for r in results[: len(prefixes) * n]]
    outcomes = [r.score for r in results[len(prefixes) * n :]]
    return group_rollouts(prefixes, rollout_correct, n, step_counts), outcomes


class SampledSolutions(NamedTuple):
    """The policy's solutions split into steps, and how many samples were dropped for having no text."""

    items: list[LabelItem]
    dropped_empty: int


def sample_solutions(
    engine,
    records: Sequence[PromptRecord],
    *,
    samples_per_prompt: int,
    sampling: SamplingConfig,
    step_pattern: str,
    seed: int,
) -> SampledSolutions:
    """``samples_per_prompt`` policy solutions per record (collective: the same on every rank), each split into
    steps with ``split_steps(text, step_pattern)``; a solution with no text is dropped and counted. ``sampling``
    gives temperature, top-p/k, max_new_tokens and stop strings; its ``n`` and ``seed`` are replaced."""
    from grpo_mega.rollout.distributed import generate_across_ranks

    if samples_per_prompt < 1:
        raise ValueError(f"sample_solutions: samples_per_prompt must be >= 1, got {samples_per_prompt}")
    per_call = dataclasses.replace(sampling, n=samples_per_prompt, seed=seed)
    completions = generate_across_ranks(engine, [r.prompt_ids for r in records], per_call, call_seed=seed)
    items, dropped = [], 0
    for position, completion in enumerate(completions):
        record = records[position // samples_per_prompt]
        steps = split_steps(completion.text, step_pattern) if completion.text.strip() else []
        if not steps:
            dropped += 1
            continue
        items.append(LabelItem(prompt=record.prompt, prompt_ids=list(record.prompt_ids), steps=steps,
                               answer=record.answer, extra=dict(record.extra),
                               source=f"{record.source}#{position % samples_per_prompt}"))
    return SampledSolutions(items, dropped)
