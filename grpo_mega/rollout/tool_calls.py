"""Reading a policy turn's text as tool calls, per tool-call format (``rollout.multi_turn.format``).

- ``hermes`` (Qwen2.5 / Qwen3, Hermes): the turn ends with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  generation stops at ``</tool_call>`` (one call per assistant turn). ``arguments`` may be an object or a JSON
  string of one (some templates write it so); ``parameters`` (Llama 3's key) is read too.
- ``code`` (ToRL): the turn ends with a fenced ```` ```python ... ``` ```` block followed by ```` ```output ````;
  generation stops at ```` ```output ````, the block runs on the ``python`` tool (argument ``code``) and its output
  is appended after the stop string (``grpo_mega.rollout.tool_turns``).

A turn that ends at the format's stop string but holds no valid call is an ``invalid_call`` error: the policy sees
the message as the tool's output and the error is counted (it is not run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from grpo_mega.tools import ToolCall  # what ToolSet.run takes

FORMATS = ("hermes", "code")
STOP_STRINGS = {"hermes": ("</tool_call>",), "code": ("```output",)}
"""Where generation pauses for a tool, per format (kept in the turn's tokens, like every stop string)."""
INVALID_CALL = "invalid_call"

@dataclass(frozen=True)
class ParsedTurn:
    """What a turn that stopped at the format's stop string asked for: a call, or why it is not one."""

    call: ToolCall | None
    error: str | None = None
    """None, or the message the policy sees in place of the tool's output (error kind ``invalid_call``)."""


def ends_in_call(text: str, fmt: str) -> bool:
    """True when the turn's text reached one of the format's stop strings (generation paused for a tool)."""
    return any(stop in text for stop in STOP_STRINGS[fmt])


def parse_turn(text: str, fmt: str) -> ParsedTurn:
    """The call at the end of a turn that stopped at the format's stop string."""
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "code":
        return _parse_code(text)
    raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")


def _parse_hermes(text: str) -> ParsedTurn:
    end = text.rfind("</tool_call>")
    start = text.rfind("<tool_call>", 0, end)
    if start < 0:
        return ParsedTurn(None, "invalid tool call: </tool_call> without an opening <tool_call>")
    body = text[start + len("<tool_call>"):end].strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return ParsedTurn(None, f"invalid tool call: not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ParsedTurn(None, 'invalid tool call: expected {"name": <tool name>, "arguments": {...}}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # arguments written as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ParsedTurn(None, "invalid tool call: arguments is a string that is not a JSON object")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ParsedTurn(None, f"invalid tool call: arguments must be an object, got {type(arguments).__name__}")
    return ParsedTurn(ToolCall(value["name"], arguments))


def _parse_code(text: str) -> ParsedTurn:
    head = text[:text.rfind("```output")]
    start = head.rfind("```python")
    if start < 0:
        return ParsedTurn(None, "no ```python block before ```output")
    body = head[start + len("```python"):].rstrip()
    if body.endswith("```"):
        body = body[:-3]
    code = body.strip("\n")
    if not code.strip():
        return ParsedTurn(None, "the ```python block is empty")
    return ParsedTurn(ToolCall("python", {"code": code}))
