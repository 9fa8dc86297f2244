"""Rewards: rule verifiers (math answers, formats, the synthetic task), user functions by import path.

A reward function is ``fn(prompt, completion, answer, **extra)`` returning a float, or :class:`StepRewards` (the
completion's reward plus one reward per reasoning step, each with the character offset where the step ends).

It may import ``data`` (the synthetic task, answer formats); the stages, the PRM and the commands import it.

The names below load their module on first use (PEP 562): the config's check of a reward function's name
(``registry``) imports no torch, so a CLI refuses a bad setting before torch's 2-3 s import.
"""

import importlib

_MODULE_OF = {
    "ON_ERROR_CHOICES": "compute",
    "REWARD_FUNCTIONS": "registry",
    "RewardError": "compute",
    "RewardFunction": "types",
    "SampleReward": "types",
    "StepRewards": "types",
    "compute_rewards": "compute",
    "get_reward_function": "registry",
    "score_across_ranks": "distributed",
    "score_samples": "compute",
}
"""Each public name and the module of this package that defines it."""

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
