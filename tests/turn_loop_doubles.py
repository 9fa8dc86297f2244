"""Test doubles of the turn-loop tests: a scripted engine (a "policy" whose turns are given as text, returned as
token ids with made-up log-probs through the engine seam) and an exact integer calculator with the interface's
ToolSet methods (``names`` / ``schemas()`` / ``run()`` / ``close()``) returning ``grpo_mega.tools.ToolResult``s."""

from __future__ import annotations

import ast
import operator
import time
from typing import Any, Callable, Mapping, Sequence

from grpo_mega.rollout.base import Completion, SamplingConfig, decode_response
from grpo_mega.rollout.stopping import cut_response
from grpo_mega.tools import ToolResult


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only integers with + - *")


class Calculator:
    """Exact integer arithmetic (``calculator``: argument ``expression``) and, for the code format, a ``python``
    tool that evaluates its ``code`` the same way. Records every ``run`` call (its calls and kwargs)."""

    names = ["calculator", "python"]

    def __init__(self, reward: float | None = None):
        self.runs: list[tuple[list, list]] = []
        self.closed = False
        self.reward = reward

    def schemas(self) -> list[dict]:
        return [{"type": "function", "function": {
            "name": "calculator", "description": "Evaluate an integer expression with + - *.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}}]

    def run(self, calls: Sequence[Any], kwargs: Sequence[Mapping[str, Any]] | None = None) -> list[ToolResult]:
        self.runs.append((list(calls), list(kwargs or [])))
        results = []
        for call in calls:
            started = time.perf_counter()
            source = call.arguments.get("expression") if call.name == "calculator" else call.arguments.get("code")
            if call.name not in self.names:
                results.append(ToolResult(f"unknown tool {call.name!r}", "unknown_tool"))
                continue
            try:
                value = str(_evaluate(ast.parse(str(source).strip(), mode="eval")))
                results.append(ToolResult(value, None, time.perf_counter() - started, self.reward))
            except (ValueError, SyntaxError) as error:
                results.append(ToolResult(f"error: {error}", "bad_arguments", time.perf_counter() - started))
        return results

    def close(self) -> None:
        self.closed = True


class ScriptedEngine:
    """An engine whose completions follow a script: ``script(prompt_index, sample, turn, prefix_text)`` gives the
    text of that turn, encoded (``encode``: the policy's ids; default the canonical encoding) with log-probs
    -0.01 * (position + 1), cut at the sampling's stop strings / EOS / max_new_tokens like the real engines
    (``grpo_mega.rollout.stopping.cut_response``). Records every generate call's prompts and sampling."""

    def __init__(self, tokenizer, script: Callable[[int, int, int, str], str],
                 encode: Callable[[str], list[int]] | None = None):
        self.tokenizer, self.script = tokenizer, script
        self.encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []
        self.rows: list[tuple[int, int, list[int], int]] = []  # (prompt index, sample, ids so far, turns so far)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        self.calls.append(([list(p) for p in prompt_ids], sampling))
        out = []
        first = not self.rows
        for index, prompt in enumerate(prompt_ids):
            for sample in range(sampling.n):
                if first:
                    self.rows.append((index, sample, list(prompt), 0))
                    row = len(self.rows) - 1
                else:
                    # the row this prefix continues: its ids so far, then the tool turn the loop appended
                    row = max((r for r, (_, _, ids, _) in enumerate(self.rows) if list(prompt[:len(ids)]) == ids),
                              key=lambda r: len(self.rows[r][2]))
                origin, number, ids, turn = self.rows[row]
                text = self.script(origin, number, turn, decode_response(self.tokenizer, ids))
                generated = self.encode(text)[: sampling.max_new_tokens]  # an engine stops at its limit
                assert self._ends(generated, sampling), f"scripted turn {text!r} has no end (stop, EOS, length)"
                cut = cut_response(generated, eos_token_ids={self.tokenizer.eos_token_id}, stop=sampling.stop,
                                   decode=lambda t: decode_response(self.tokenizer, t),
                                   max_new_tokens=sampling.max_new_tokens)
                kept, reason = generated[: cut.length], cut.finish_reason
                self.rows[row] = (origin, number, list(prompt) + kept, turn + 1)
                out.append(Completion(index, list(prompt), kept, [-0.01 * (k + 1) for k in range(len(kept))],
                                      decode_response(self.tokenizer, kept), reason))
        return out

    def _ends(self, generated: list[int], sampling: SamplingConfig) -> bool:
        """True when the scripted text ends somewhere cut_response can find (it raises otherwise)."""
        text = decode_response(self.tokenizer, generated)
        return (len(generated) >= sampling.max_new_tokens or self.tokenizer.eos_token_id in generated
                or any(s in text for s in sampling.stop))

    # the weight-update half of the protocol, never called here
    def begin_weight_update(self): ...
    def update_weights(self, named_tensors): ...
    def finish_weight_update(self): ...
