"""Held-out evaluation of the policy through the rollout engine: the mean verifier score (the accuracy for a 0/1
verifier) of one completion per prompt, greedy unless a temperature is given."""

from __future__ import annotations

from typing import Callable, Sequence

from grpo_mega.data.prompts import PromptRecord
from grpo_mega.reward import score_across_ranks
from grpo_mega.rollout.base import RolloutEngine, SamplingConfig
from grpo_mega.rollout.distributed import generate_across_ranks


def evaluate(
    engine: RolloutEngine,
    records: Sequence[PromptRecord],
    reward_fn,
    *,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    temperature: float = 0.0,
    seed: int = 0,
    on_error: str = "zero",
    on_completions: Callable[..., dict[str, float]] | None = None,
) -> dict[str, float]:
    """``{"eval/accuracy", "eval/response_length", "eval/num_prompts", "eval/reward_failures"}`` over ``records``
    (collective; each completion is scored once, on one rank, see ``score_across_ranks``); with
    ``on_completions(records, completions, scores)`` (collective too), its metrics of the evaluated completions
    beside them (the implicit PRM's step F1)."""
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens, stop=list(stop), n=1)
    completions = generate_across_ranks(engine, [r.prompt_ids for r in records], sampling, call_seed=seed)
    results = score_across_ranks(
        reward_fn,
        [r.prompt for r in records],
        [c.text for c in completions],
        [r.answer for r in records],
        [r.extra for r in records],
        on_error=on_error,
    )
    lengths = [len(c.response_ids) for c in completions]
    extra = on_completions(records, completions, [r.score for r in results]) if on_completions is not None else {}
    return {
        **extra,
        "eval/accuracy": sum(r.score for r in results) / len(results),
        "eval/reward_failures": float(sum(r.failed for r in results)),
        "eval/response_length": sum(lengths) / len(lengths),
        "eval/num_prompts": float(len(records)),
    }
