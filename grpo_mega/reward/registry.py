"""Reward functions by name: built-in rules, or user functions given as ``"package.module:function"`` or as a file
``"path/to/file.py:function"`` (absolute, or relative to the current folder: verl's ``custom_reward_function.path``
and ``.name``).

A reward function has grpo-mega's signature ``fn(prompt: str, completion: str, answer: str, **extra)`` and returns
a float or ``StepRewards`` (``grpo_mega.reward.types``); ``extra`` carries the dataset row's other fields (for
example the synthetic task's ``steps``). A user function with verl's or TRL's signature is called through an adapter
(``grpo_mega.reward.adapters``). A module is looked up in the current folder too, in every command and process
count alike (``torchrun`` and ``python -m`` put it first on the path; a console script does not).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from grpo_mega.reward.adapters import RewardRows, adapt, weighted_sum
from grpo_mega.reward.format import boxed_format_reward, step_format_reward
from grpo_mega.reward.math_answer import math_verify_reward
from grpo_mega.reward.synthetic import synthetic_reward, synthetic_step_reward
from grpo_mega.reward.tool_task import tool_task_turn_reward
from grpo_mega.reward.types import RewardFunction
from grpo_mega.reward.verl_sources import verl_default_reward


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_verify": math_verify_reward,
    "synthetic": synthetic_reward,
    "synthetic_steps": synthetic_step_reward,
    "tool_task_turns": tool_task_turn_reward,
    "step_format": step_format_reward,
    "boxed_format": boxed_format_reward,
    "verl_default": verl_default_reward,
}


def is_file_spec(spec: str) -> bool:
    """Whether ``spec`` names a Python file (``file.py:function``, a path with ``/``) rather than a module."""
    location = spec.rpartition(":")[0]
    return location.endswith(".py") or "/" in location or os.sep in location


def _load_file(location: str, spec: str, what: str = "reward function"):
    """The module of the file ``location`` (relative to the current folder), loaded once per process."""
    path = Path(location).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    if not path.is_file():
        raise ImportError(f"{what} {spec!r}: no such file {path}")
    name = f"grpo_mega_reward_file_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(module_name: str, spec: str, what: str = "reward function"):
    """``module_name`` imported, the current folder searched after the installed packages."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ImportError(f"{what} {spec!r}: cannot import module {module_name!r} ({error}); searched the "
                          f"current folder {here} and the installed packages: run from the folder that holds it, "
                          f"or give its file, path/to/{module_name.replace('.', '/')}.py:function") from error


def import_user_function(spec: str, what: str = "reward function") -> Callable:
    """``"module:attribute"`` or ``"file.py:attribute"`` -> the attribute, with errors that say which part is
    missing (``what`` names the kind of function in them; the tools' sandbox imports user tools with it too)."""
    location, _, attribute_path = spec.rpartition(":")
    if not location or not attribute_path:
        raise ValueError(f"{what} {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    module = _load_file(location, spec, what) if is_file_spec(spec) else _import_module(location, spec, what)
    target = module
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise AttributeError(f"{what} {spec!r}: {location} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    return target


def get_reward_function(spec: str, layout: RewardRows = RewardRows()) -> RewardFunction:
    """A built-in reward by name (see ``REWARD_FUNCTIONS``) or a user function (``"package.module:function"``,
    ``"path/to/file.py:function"``), verl's and TRL's signatures adapted (``layout``: what TRL's needs to know of
    the rows).

    Raises ValueError for an unknown name or an unusable signature, ImportError / AttributeError when a user
    function cannot be found, and TypeError when what was found is not callable.
    """
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward function {spec!r}: use one of {sorted(REWARD_FUNCTIONS)}, "
                         "'package.module:function' or 'path/to/file.py:function'")
    function = import_user_function(spec)
    if not callable(function):
        raise TypeError(f"reward function {spec!r} is a {type(function).__name__}, not callable")
    return adapt(function, spec, layout)


def reward_specs(function: str, functions: Sequence[str], weights: Sequence[float]) -> list[tuple[str, float]]:
    """(spec, weight) of every verifier of ``reward.function`` / ``reward.functions`` / ``reward.weights``:
    ``functions`` when given (each weight 1 unless ``weights``), else ``function`` alone with weight 1."""
    if not functions:
        return [(function, 1.0)]
    weights = list(weights) if weights else [1.0] * len(functions)
    if len(weights) != len(functions):
        raise ValueError(f"reward.weights has {len(weights)} values for {len(functions)} reward.functions: give one "
                         "weight per function (or none: each 1)")
    return list(zip(functions, weights))


def build_reward_function(function: str, functions: Sequence[str] = (), weights: Sequence[float] = (),
                          layout: RewardRows = RewardRows()) -> RewardFunction:
    """The run's verifier: the one function (its step rewards kept), or the weighted sum of several
    (``grpo_mega.reward.adapters.weighted_sum``)."""
    specs = reward_specs(function, functions, weights)
    if len(specs) == 1 and specs[0][1] == 1.0:
        return get_reward_function(specs[0][0], layout)
    return weighted_sum([(spec, get_reward_function(spec, layout)) for spec, _ in specs], [w for _, w in specs])
