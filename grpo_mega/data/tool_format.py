"""The text of Hermes-style tool calls and of the fallback tool turn: one home for the strings that the synthetic
tool task's demonstrations, its reward and the multi-turn rollout loop must agree on.

A policy calls a tool by writing (Qwen2.5 / Qwen3 "hermes" style)

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 86"}}</tool_call>

and, when the tokenizer has no chat template (the synthetic tokenizer has none), the tool's answer is appended to
the trajectory as raw text, the *fallback tool turn*:

    <tool_response>29842</tool_response>

Token in, token out: the rollout loop encodes the tool turn on its own (``tokenizer.encode(fallback_tool_turn_text(
content), add_special_tokens=False)``) and keeps the policy's sampled tokens as they are; SFT demonstrations are
encoded the same way, segment by segment (``grpo_mega.data.tool_task.encode_segments``). Pure strings and json: no
torch import.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
"""The policy's turn ends at (and includes) this: the rollout loop stops generating there and runs the call."""
FALLBACK_RESPONSE_OPEN = "<tool_response>"
FALLBACK_RESPONSE_CLOSE = "</tool_response>"

_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def fallback_tool_turn_text(content: str) -> str:
    """The text of one tool turn in the fallback rendering (no chat template): ``<tool_response>CONTENT</tool_response>``,
    appended right after the policy's ``</tool_call>`` with nothing in between, CONTENT verbatim."""
    return f"{FALLBACK_RESPONSE_OPEN}{content}{FALLBACK_RESPONSE_CLOSE}"


def hermes_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` with ``json.dumps``'s default separators
    (", " and ": "), the form Qwen2.5's template writes."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{TOOL_CALL_CLOSE}"


def parse_hermes_call(text: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of the last ``<tool_call>{json}</tool_call>`` in ``text``; ValueError with a short reason
    (what the policy would be told) when there is none or it is not ``{"name": str, "arguments": object}``."""
    calls = _CALL.findall(text)
    if not calls:
        raise ValueError(f"no {TOOL_CALL_OPEN}...{TOOL_CALL_CLOSE} in the text")
    try:
        call = json.loads(calls[-1])
    except json.JSONDecodeError as error:
        raise ValueError(f"the tool call is not valid JSON ({error.msg})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('the tool call must be a JSON object with a string "name"')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ValueError('the tool call\'s "arguments" must be a JSON object')
    return call["name"], arguments
