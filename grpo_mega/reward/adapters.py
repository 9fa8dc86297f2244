"""Reward functions written for verl or TRL, called as grpo-mega's ``fn(prompt, completion, answer, **extra)``.

Users bring the reward code they already have. The three signatures are told apart by their parameter names
(:func:`signature_kind`), never by a flag:

- **verl** (``custom_reward_function``): ``compute_score(data_source, solution_str, ground_truth, extra_info=None,
  **kwargs)``, any function with a ``solution_str`` parameter (or both ``data_source`` and ``ground_truth``). Called
  with keywords as verl's reward manager calls it: the row's ``data_source`` and ``extra_info`` columns, the
  completion, and the gold ``answer`` (verl's ``reward_model.ground_truth``: when the answer field is not set, that
  nested value of the row); the row's other columns too when it takes ``**kwargs`` or names them. It returns a
  number, or a dict whose ``"score"`` is the reward (verl's other keys are its extra logging, not used here).
- **TRL** (``GRPOTrainer(reward_funcs=...)``): ``reward(completions, **kwargs) -> list[float]``, any function with
  a ``completions`` parameter. Called with lists: ``prompts``, ``completions`` and every column of the rows as TRL
  passes them (the answer column under its own name, ``data.answer_field``); for conversation rows
  (``data.messages_field``) the completion is ``[{"role": "assistant", "content": text}]`` and the prompt
  ``[{"role": "user", "content": prompt}]``; a multi-turn rollout's completion (``rollout.multi_turn``) is its
  messages, the assistant's turns with a ``{"role": "tool", ...}`` message after each call, as TRL gives them with
  ``tools`` (``grpo_mega.rollout.turn_messages``). A None in the returned list means "not applicable to this sample", as
  in TRL. The samples a rank scores go to it in one call, as TRL calls it (``score_batch``); when that call raises,
  they go one at a time, so that the error names the sample. Not passed: ``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric``, ``environments``; a
  function that requires one is refused when it is loaded.
- **grpo-mega**: anything else that takes ``(prompt, completion, answer)`` positionally.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from grpo_mega.reward.types import StepRewards, WeightedScore

VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRAJECTORY_MESSAGES = "completion_messages"
"""The key under which the rollout stage gives a multi-turn completion's messages to the reward functions, beside
the row's columns (``**extra``; ``grpo_mega.rollout.turn_messages``); TRL's adapter passes them as the
``completions`` of conversational rows."""
TRL_NOT_PASSED = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
"""What TRL's GRPOTrainer passes a reward function that grpo-mega has no equivalent of (token ids, its trainer
state, its logging hooks, its environments)."""


@dataclass(frozen=True)
class RewardRows:
    """What an adapter must know of the dataset to call a TRL function as TRL would: the answer column's name
    (``data.answer_field``) and whether rows are conversations (``data.messages_field`` set)."""

    answer_field: str | None = "answer"
    conversational: bool = False


def reward_rows_of(data: Any) -> RewardRows:
    """The :class:`RewardRows` of a config's ``data`` section: the train file's layout (``data.format``; ``auto``:
    from its first row, ``grpo_mega.data.formats``), else what its keys say."""
    from grpo_mega.data.formats import field_settings
    from grpo_mega.data.prompt_rows import file_layout

    layout = file_layout(data.train_file, field_settings(data))
    if layout is None:
        return RewardRows(data.answer_field, data.messages_field is not None)
    return RewardRows(layout.answer_field, layout.conversation)


def signature_kind(fn: Callable) -> str:
    """``"verl"``, ``"trl"`` or ``"native"`` (grpo-mega's), from ``fn``'s parameter names; a callable whose
    signature cannot be read is taken as native."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "native"
    if "solution_str" in names or {"data_source", "ground_truth"} <= names:
        return "verl"
    if "completions" in names:
        return "trl"
    return "native"


def adapt(fn: Callable, spec: str, layout: RewardRows = RewardRows()) -> Callable:
    """``fn`` (found by ``spec``) as a grpo-mega reward function; ValueError naming ``spec`` when its signature is
    none of the three (the message shows it and the forms accepted)."""
    kind = signature_kind(fn)
    if kind == "verl":
        return _verl_reward(fn, spec)
    if kind == "trl":
        return _trl_reward(fn, spec, layout)
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError:
        raise ValueError(
            f"reward function {spec!r} has the signature {inspect.signature(fn)}, which is none of the three "
            "accepted: grpo-mega's fn(prompt, completion, answer, **extra), verl's compute_score(data_source, "
            "solution_str, ground_truth, extra_info=None, **kwargs), TRL's reward(completions, **kwargs)") from None
    except ValueError:  # no readable signature: called as grpo-mega's
        pass
    return fn


def _parameters(fn: Callable) -> tuple[set[str], bool]:
    """(``fn``'s parameter names, whether it takes ``**kwargs``)."""
    parameters = inspect.signature(fn).parameters
    return set(parameters), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _named(fn: Callable, spec: str, kind: str, call: Callable) -> Callable:
    call.__qualname__ = f"{spec} ({kind} signature)"
    call.__name__ = getattr(fn, "__name__", spec)
    call.__wrapped__ = fn
    call.signature_kind = kind
    return call


def verl_score(value: Any, spec: str) -> Any:
    """The reward of a verl ``compute_score`` result: a number as it is, a dict's ``"score"``."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function {spec!r} returned a dict without a 'score' key (keys "
                             f"{sorted(value)}): verl's form is {{'score': float, ...}}")
        return value["score"]
    return value


def _verl_reward(fn: Callable, spec: str) -> Callable:
    names, takes_kwargs = _parameters(fn)

    def verl_reward(prompt: str, completion: str, answer: str | None, **extra) -> float:
        ground_truth = answer
        nested = extra.get("reward_model")
        if ground_truth is None and isinstance(nested, dict):  # verl's row layout, answer field not set
            ground_truth = nested.get("ground_truth")
        kwargs = {"data_source": extra.get("data_source"), "solution_str": completion, "ground_truth": ground_truth}
        if "extra_info" in names or takes_kwargs:
            kwargs["extra_info"] = extra.get("extra_info")
        for key, value in extra.items():  # the row's other columns, where the function takes them
            if key not in kwargs and key not in VERL_PARAMETERS and (takes_kwargs or key in names):
                kwargs[key] = value
        return verl_score(fn(**kwargs), spec)

    return _named(fn, spec, "verl", verl_reward)


def _trl_reward(fn: Callable, spec: str, layout: RewardRows) -> Callable:
    signature = inspect.signature(fn)
    required = [name for name, p in signature.parameters.items()
                if name in TRL_NOT_PASSED and p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    if required:
        raise ValueError(f"reward function {spec!r} requires {', '.join(required)}, which grpo-mega does not pass "
                         f"(it passes prompts, completions and the row's columns): give {required[0]} a default")
    answer_field = layout.answer_field if layout.answer_field and "." not in layout.answer_field else None

    def score_batch(prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None],
                    extras: Sequence[dict]) -> list:
        """TRL's call: every sample at once, each column a list (a row without a column gives None)."""
        names = dict.fromkeys(key for extra in extras for key in extra
                              if key not in ("prompts", "completions", TRAJECTORY_MESSAGES))
        columns = {key: [extra.get(key) for extra in extras] for key in names}
        if answer_field is not None and answer_field not in columns:
            columns[answer_field] = list(answers)
        if layout.conversational:
            prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
            completions = [extra.get(TRAJECTORY_MESSAGES) or [{"role": "assistant", "content": completion}]
                           for completion, extra in zip(completions, extras)]
        values = fn(prompts=list(prompts), completions=list(completions), **columns)
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != len(completions):
            raise ValueError(f"reward function {spec!r} returned {values!r:.80} for {len(completions)} "
                             f"completion(s): TRL's form is a list with one reward (or None) per completion")
        return list(values)

    def trl_reward(prompt: str, completion: str, answer: str | None, **extra) -> float | None:
        return score_batch([prompt], [completion], [answer], [extra])[0]

    trl_reward.score_batch = score_batch
    return _named(fn, spec, "TRL", trl_reward)


def weighted_sum(functions: Sequence[tuple[str, Callable]], weights: Sequence[float]) -> Callable:
    """One reward function that returns ``sum_i weights[i] * functions[i](...)`` (TRL's ``reward_weights``): a
    function that returns None (not applicable, TRL's convention) adds nothing; None when every one of them does.
    A StepRewards counts by its score. A function that raises, or returns a non-number, fails the sample, naming
    it."""
    if len(functions) != len(weights):
        raise ValueError(f"{len(functions)} reward functions but {len(weights)} weights")
    names = metric_names([name for name, _ in functions])

    def weighted(prompt: str, completion: str, answer: str | None, **extra) -> float | None:
        values = []
        for name, fn in functions:
            try:
                values.append((name, fn(prompt, completion, answer, **extra)))
            except Exception as error:
                if not _rebuildable(error):
                    raise
                raise type(error)(f"{name}: {error}") from error
        return _weighted_value(values, weights, names)

    def score_batch(prompts, completions, answers, extras) -> list:
        """Every function on the whole batch (a TRL function in one call), summed per sample as above."""
        per_function = [
            fn.score_batch(prompts, completions, answers, extras) if hasattr(fn, "score_batch")
            else [fn(p, c, a, **e) for p, c, a, e in zip(prompts, completions, answers, extras)]
            for _, fn in functions]
        return [_weighted_value([(name, values[i]) for (name, _), values in zip(functions, per_function)], weights,
                                names) for i in range(len(completions))]

    weighted.__qualname__ = " + ".join(f"{weight:g} x {name}" for (name, _), weight in zip(functions, weights))
    if any(hasattr(fn, "score_batch") for _, fn in functions):
        weighted.score_batch = score_batch
    return weighted


def _weighted_value(values: Sequence[tuple[str, Any]], weights: Sequence[float],
                    names: Sequence[str]) -> WeightedScore | None:
    """``sum_i weights[i] * values[i]`` over the values that are not None (None when all are), each function's own
    value kept under its metric name (``names``); ValueError naming the function of a value that is no finite
    number."""
    total, applicable, components = 0.0, False, {}
    for (name, value), weight, metric in zip(values, weights, names):
        components[metric] = None
        if value is None:
            continue
        value = value.score if isinstance(value, StepRewards) else value
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(f"{name} returned {value!r:.80}: expected a finite number (or None: not applicable)")
        total, applicable, components[metric] = total + weight * float(value), True, float(value)
    return WeightedScore(total, components) if applicable else None


def metric_names(specs: Sequence[str]) -> list[str]:
    """The name each reward function's metrics go by: its function's name, as TRL's ``rewards/<func.__name__>``
    (``my_rewards.py:accuracy`` -> ``accuracy``; a built-in by its name), or the whole spec where two would share
    one."""
    short = [spec.rsplit(":", 1)[-1] for spec in specs]
    return [name if short.count(name) == 1 else spec for name, spec in zip(short, specs)]


def _rebuildable(error: Exception) -> bool:
    """Whether ``type(error)(message)`` makes an exception of the same type (most built-in ones)."""
    try:
        return isinstance(type(error)("x"), type(error))
    except Exception:
        return False
