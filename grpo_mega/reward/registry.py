"""Reward functions by name: built-in rules, or user functions given as ``"package.module:function"``.

Every reward function has the signature ``fn(prompt: str, completion: str, answer: str, **extra)`` and returns a
float or ``StepRewards`` (``grpo_mega.reward.types``); ``extra`` carries the dataset row's other fields (for example
the synthetic task's ``steps``).
"""

from __future__ import annotations

import importlib
from typing import Callable

from grpo_mega.reward.format import boxed_format_reward, step_format_reward
from grpo_mega.reward.math_answer import math_verify_reward
from grpo_mega.reward.synthetic import synthetic_reward, synthetic_step_reward
from grpo_mega.reward.types import RewardFunction


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_verify": math_verify_reward,
    "synthetic": synthetic_reward,
    "synthetic_steps": synthetic_step_reward,
    "step_format": step_format_reward,
    "boxed_format": boxed_format_reward,
}


def _import_user_function(spec: str) -> Callable:
    """``"module:attribute"`` -> the attribute, with errors that say which part is missing."""
    module_name, _, attribute_path = spec.partition(":")
    if not module_name or not attribute_path:
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ImportError(f"reward function {spec!r}: cannot import module {module_name!r} ({error})") from error
    target = module
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise AttributeError(f"reward function {spec!r}: module {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    return target


def get_reward_function(spec: str) -> RewardFunction:
    """A built-in reward by name (see ``REWARD_FUNCTIONS``) or a user function ``"package.module:function"``.

    Raises ValueError for an unknown name, ImportError / AttributeError when a user function cannot be found, and
    TypeError when what was found is not callable.
    """
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward function {spec!r}: use one of {sorted(REWARD_FUNCTIONS)} or 'package.module:function'"
        )
    function = _import_user_function(spec)
    if not callable(function):
        raise TypeError(f"reward function {spec!r} is a {type(function).__name__}, not callable")
    return function
