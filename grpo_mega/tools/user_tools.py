"""User tools: a Python function named like a user reward function (``path/to/file.py:fn`` or ``package.module:fn``,
resolved by ``grpo_mega.reward.registry.import_user_function``), its JSON schema read from its signature's type
hints and its Google-style docstring by transformers' ``get_json_schema`` (the schema ``apply_chat_template(tools=)``
expects).

Keyword-only parameters (after ``*``) are the row's: they are left out of the schema the policy sees and filled from
the data row's per-tool arguments (verl's ``extra_info.tools_kwargs``), which win over any argument of the same name
the policy passes, so that a policy cannot hand a tool its own "ground truth". A tool returns a str, a
``(str, float)`` pair or a dict ``{"content": str, "reward": float}``: the float is that turn's reward.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from grpo_mega.reward.registry import import_user_function

_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}
# verl's tools_kwargs[name] holds these; their create / execute arguments are the ones a call takes
_VERL_KWARG_GROUPS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


class BadArguments(ValueError):
    """The policy's arguments do not fit the tool's signature."""


@dataclass(frozen=True)
class UserTool:
    """A user tool, imported: the spec it came from, its function, and its schema."""

    spec: str
    function: Callable
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def _schema_view(function: Callable) -> Callable:
    """A stand-in with the function's name, docstring and signature minus keyword-only and ``*args`` / ``**kwargs``
    parameters, so that ``get_json_schema`` describes what the policy passes and nothing else."""
    signature = inspect.signature(function)
    shown = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def view(*args, **kwargs):  # never called
        raise NotImplementedError

    view.__name__ = view.__qualname__ = getattr(function, "__name__", "tool")
    view.__doc__ = inspect.getdoc(function)
    view.__signature__ = signature.replace(parameters=shown)
    view.__wrapped__ = function  # get_type_hints resolves string annotations in the function's module
    view.__annotations__ = {k: v for k, v in getattr(function, "__annotations__", {}).items()
                            if k in {p.name for p in shown} or k == "return"}
    return view


def load_user_tool(spec: str) -> UserTool:
    """Imports ``spec`` and builds its schema. Raises ValueError with one line naming the spec for anything a
    user must fix (no such file or module or attribute, not callable, a missing type hint or docstring entry)."""
    try:
        function = import_user_function(spec, what="user tool")
    except Exception as error:  # ours name the spec; an error the module raised while importing does not
        message = (str(error).splitlines() or [""])[0]
        if repr(spec) not in message:
            message = f"user tool {spec!r}: importing it raised {type(error).__name__}: {message}"
        raise ValueError(message) from None
    if not callable(function):
        raise ValueError(f"user tool {spec!r} is a {type(function).__name__}, not callable")
    from transformers.utils.chat_template_utils import get_json_schema  # lazy: transformers is slow to import
    try:
        schema = get_json_schema(_schema_view(function))
    except Exception as error:
        raise ValueError(f"user tool {spec!r}: cannot build its JSON schema: {error} (give every parameter a type "
                         "hint and a line in the docstring's Args: section)") from None
    return UserTool(spec, function, schema)


def flat_row_kwargs(row_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's per-tool arguments as one dict: verl's ``{"create_kwargs": {...}, "execute_kwargs": {...}}`` merged,
    anything else as given."""
    if not row_kwargs:
        return {}
    if set(row_kwargs) <= set(_VERL_KWARG_GROUPS):
        return {**row_kwargs.get("create_kwargs", {}), **row_kwargs.get("execute_kwargs", {})}
    return dict(row_kwargs)


def call_arguments(tool: UserTool, arguments: Mapping[str, Any], row_kwargs: Mapping[str, Any] | None) -> dict:
    """The keyword arguments of one call: the policy's, checked against the schema (names, required, JSON types),
    then the row's for the parameters the function accepts. Raises BadArguments with a message for the policy."""
    if not isinstance(arguments, Mapping):
        raise BadArguments(f"arguments must be a JSON object, got {type(arguments).__name__}")
    parameters = tool.schema["function"]["parameters"]
    properties = parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        raise BadArguments(f"{tool.name} has no argument {', '.join(map(repr, unknown))}; it takes "
                           f"{', '.join(properties) or 'none'}")
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        raise BadArguments(f"{tool.name} needs the argument {', '.join(map(repr, missing))}")
    for name, value in arguments.items():
        expected = properties[name].get("type")
        allowed = expected if isinstance(expected, list) else [expected] if expected else []
        if allowed and not any(isinstance(value, _JSON_TYPES.get(kind, object)) and
                               not (kind in ("integer", "number") and isinstance(value, bool)) for kind in allowed):
            raise BadArguments(f"{tool.name}: argument {name!r} must be {' or '.join(allowed)}, got "
                               f"{json.dumps(value, default=repr)[:80]}")
    accepted = inspect.signature(tool.function).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
    extra = {k: v for k, v in flat_row_kwargs(row_kwargs).items() if takes_any or k in accepted}
    return {**arguments, **extra}


def tool_answer(value: Any) -> tuple[str, float | None]:
    """A user tool's return value as (content, reward): a str, a (str, float) pair, a dict with "content" and
    optionally "reward"; any other value is shown as JSON (or its str when it is not JSON)."""
    reward = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float)):
        value, reward = value
    elif isinstance(value, dict) and "content" in value and set(value) <= {"content", "reward"}:
        value, reward = value["content"], value.get("reward")
    if reward is not None:
        reward = float(reward)
    if isinstance(value, str):
        return value, reward
    try:
        return json.dumps(value), reward
    except (TypeError, ValueError):
        return str(value), reward
