"""Error injection for PRM training data: ``grpo-mega prm label --perturb-fraction F``.

A policy that is right most of the time samples few solutions with a wrong intermediate result, so its Monte-Carlo
labels hold few examples of the error a PRM most needs to catch: a step whose arithmetic is wrong, followed by steps
that carry the wrong value on. For a fraction ``F`` of the sampled solutions with more than one step, one step k,
drawn uniformly among the steps before the last that hold a number, gets its last number replaced by a different
one within 9 of it (never negative when it was not), and the policy writes the rest of the solution from the changed
prefix (one sample at the labelling temperature). The copy then joins the solutions to label: its labels come from
Monte-Carlo rollouts like every other solution's, not from a checker, so this works for any task whose steps state
numbers, and a change the answer does not depend on is labelled good by the rollouts.

The draws use ``random.Random(seed)`` over the items in order, so every rank makes the same copies.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import NamedTuple, Sequence

from grpo_mega.data.step_split import split_steps
from grpo_mega.rollout.base import SamplingConfig
from grpo_mega.rollout.distributed import generate_across_ranks
from prm.labeling import LabelItem, prefix_token_ids

_NUMBER = re.compile(r"\d+")
MAX_SHIFT = 9
"""A changed number differs from the original by 1 .. MAX_SHIFT."""


class Perturbation(NamedTuple):
    """Item ``item``'s first ``step`` steps kept, then ``step_text`` (its step ``step`` with one number changed)."""

    item: int
    step: int
    step_text: str


def change_last_number(step: str, rng: random.Random) -> str | None:
    """``step`` with its last number (a run of digits) replaced by a different one within ``MAX_SHIFT`` of it and
    not below 0, or None when the step holds no number. A leading minus sign is left alone, so the magnitude moves."""
    matches = list(_NUMBER.finditer(step))
    if not matches:
        return None
    last = matches[-1]
    value = int(last.group())
    choices = [value + shift for shift in range(-MAX_SHIFT, MAX_SHIFT + 1) if shift and value + shift >= 0]
    return step[: last.start()] + str(rng.choice(choices)) + step[last.end():]


def check_fraction(fraction: float) -> None:
    """Raise ValueError naming ``--perturb-fraction`` unless ``fraction`` is in [0, 1]."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--perturb-fraction must be in [0, 1], got {fraction}")


def plan_perturbations(step_lists: Sequence[Sequence[str]], fraction: float, seed: int) -> list[Perturbation]:
    """Which solutions get a perturbed copy, and where (see the module docstring). ``step_lists[i]``: the steps
    of solution i. A solution drawn whose steps before the last hold no number gets no copy."""
    check_fraction(fraction)
    rng = random.Random(seed)
    plans = []
    for index, steps in enumerate(step_lists):
        if len(steps) < 2 or rng.random() >= fraction:
            continue
        candidates = [k for k, step in enumerate(steps[:-1]) if _NUMBER.search(step)]
        if not candidates:
            continue
        k = rng.choice(candidates)
        plans.append(Perturbation(index, k, change_last_number(steps[k], rng)))
    return plans


def perturbed_solutions(engine, tokenizer, items: Sequence[LabelItem], plans: Sequence[Perturbation], *,
                        sampling: SamplingConfig, step_pattern: str, seed: int) -> list[LabelItem]:
    """One new ``LabelItem`` per plan: the kept steps, the changed step, then the steps of one policy continuation
    from that prefix (collective: every rank passes the same arguments and gets the same items). ``sampling``
    gives temperature, top-p/k, max_new_tokens and stop strings; its ``n`` and ``seed`` are replaced."""
    if not plans:
        return []
    prefixes = [dataclasses.replace(items[p.item], steps=[*items[p.item].steps[: p.step], p.step_text],
                                    source=f"{items[p.item].source}~perturbed@{p.step + 1}") for p in plans]
    prompt_ids = [prefix_token_ids(tokenizer, prefix, len(prefix.steps)) for prefix in prefixes]
    completions = generate_across_ranks(engine, prompt_ids, dataclasses.replace(sampling, n=1, seed=seed),
                                        call_seed=seed)
    return [dataclasses.replace(prefix, steps=prefix.steps + split_steps(completion.text, step_pattern))
            if completion.text.strip() else prefix
            for prefix, completion in zip(prefixes, completions)]
