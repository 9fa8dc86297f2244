"""The multi-turn rollout (``rollout.multi_turn``): generate until a tool call, run the tools, append their turn,
continue, until an answer, ``max_turns``, the per-turn token limit or the response budget.

One seam: :class:`TurnLoopEngine` wraps any rollout engine and is itself one (``generate``, the weight updates
and everything else pass through), so the rollout stage, the evaluation, the async rollout world and both engines
run it unchanged. Its ``generate``:

1. first turn: ``engine.generate(prompts, sampling)`` with ``n = G`` and the format's stop string added
   (``grpo_mega.rollout.tool_calls``);
2. every completion that stopped at a call is parsed; the calls of all rows of the turn run at once
   (``ToolSet.run``, concurrently on the sandbox's pool), each with its row's ``tools_kwargs`` (verl's
   ``extra_info.tools_kwargs[tool name]``);
3. the tool turn's tokens (``grpo_mega.rollout.tool_turns``) are appended with mask 0 and log-prob 0;
4. the next turn is ``engine.generate`` over the live rows' whole token prefixes (``n = 1``, seed
   ``derive_seed(seed, turn)``; split into a few calls where one would pass the context, ``_continue``), until every
   row has ended.

Token in, token out: the policy's sampled ids and log-probs are kept exactly; only tool outputs and the template's
turn boundaries are encoded. vLLM's prefix cache serves each row's prefix on the next turn. An engine that can keep
its rows' KV caches (``continues_kv``: the hf engine on a model whose layers are all full attention) continues them
instead (``generate_with_caches``): each call keeps the cache of every row that stopped at a call, and the next
turn's call starts from it, prefilling only the last sampled token, the tool turn and the boundary tokens; the
prefix is never recomputed. Its calls, batches and random numbers are those of the recomputing path, so the
trajectories are the same (up to the float rounding of a differently laid-out batch, which can only flip a near
tie). Memory: between turns, the caches of the rows waiting for a tool, at most rows x (prompt + response budget)
positions x 2 x layers x KV heads x head dim x the dtype's bytes, the KV cache of the step's rollouts at full
length (one generate call's batch cache on top while the next turn runs). A turn that runs past
``max_tokens_per_turn`` or the response budget (``algorithm.response_length``, tool turns included) ends its
rollout ("length"); so does a tool turn that would not leave one token of budget (it is not appended). A call made
in the ``max_turns``-th turn is not run: the rollout ends there.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from grpo_mega.reward.answer_span import final_answer_end
from grpo_mega.rollout.base import (Completion, SamplingConfig, ToolCallRecord, TurnRecord, decode_response,
                                    derive_seed)
from grpo_mega.rollout.tool_calls import FORMATS, INVALID_CALL, STOP_STRINGS, ends_in_call, parse_turn
from grpo_mega.rollout.tool_turns import TRUNCATE_SIDES, ToolTurns, cap_tool_output, tool_turns_for


@dataclass(frozen=True)
class TurnLoopSettings:
    """How a multi-turn rollout runs (``rollout.multi_turn``; the budget is ``algorithm.response_length``)."""

    max_response_tokens: int
    """Tokens of a whole response, tool turns included."""
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    """None: the response budget."""
    max_tool_response_tokens: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"multi-turn format must be one of {FORMATS}, got {self.format!r}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}")
        for name in ("max_response_tokens", "max_turns", "max_tool_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class _Row:
    """One rollout in progress."""

    prompt_index: int
    prompt_ids: list[int]
    kwargs: Mapping[str, Any]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    finish_reason: str = "length"
    live: bool = True
    cache: Any = None
    """The engine's KV cache of the row's tokens so far (``generate_with_caches``), while it waits for its tool."""

    def add(self, ids: Sequence[int], logprobs: Sequence[float], mask_value: int) -> None:
        self.response_ids += list(ids)
        self.logprobs += list(logprobs)
        self.mask += [mask_value] * len(ids)


class TurnLoopEngine:
    """A rollout engine whose ``generate`` runs the turn loop over ``engine`` with ``toolset`` (see the module
    docstring). ``tool_seconds``: wall-clock seconds spent in ``ToolSet.run`` since the last ``pop_tool_seconds``."""

    def __init__(self, engine, toolset, tokenizer, settings: TurnLoopSettings, tool_turns: ToolTurns | None = None):
        self.engine, self.toolset, self.tokenizer, self.settings = engine, toolset, tokenizer, settings
        self.tool_turns = tool_turns if tool_turns is not None else tool_turns_for(settings.format, tokenizer)
        self.tool_seconds = 0.0
        self.continues_kv = bool(getattr(engine, "continues_kv", False)) and hasattr(engine, "generate_with_caches")
        """Whether later turns continue the rows' KV caches (else each turn recomputes the rows' prefixes)."""

    def __getattr__(self, name: str):  # weight updates, replica layout, release_memory, ...: the engine's
        return getattr(self.__dict__["engine"], name)

    def pop_tool_seconds(self) -> float:
        seconds, self.tool_seconds = self.tool_seconds, 0.0
        return seconds

    def close(self) -> None:
        """Stop the tools' pool, then the engine (if it has anything to close)."""
        try:
            self.toolset.close()
        finally:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 tool_kwargs: Sequence[Mapping[str, Any]] | None = None) -> list[Completion]:
        """``sampling.n`` multi-turn completions per prompt, grouped contiguously like any engine's.
        ``tool_kwargs[p]``: prompt p's per-tool keyword arguments ({tool name: {argument: value}})."""
        s = self.settings
        stop = list(sampling.stop) + [x for x in STOP_STRINGS[s.format] if x not in sampling.stop]
        per_turn = min(s.max_tokens_per_turn or s.max_response_tokens, s.max_response_tokens)
        first, caches = self._generate(prompt_ids, dataclasses.replace(
            sampling, stop=stop, max_new_tokens=min(per_turn, s.max_response_tokens)), keep=s.max_turns > 1)
        rows = [_Row(c.prompt_index, list(prompt_ids[c.prompt_index]),
                     (tool_kwargs[c.prompt_index] if tool_kwargs is not None else None) or {}, cache=cache)
                for c, cache in zip(first, caches)]
        context = getattr(self.engine, "context_length", None)  # None: the engine stops at its context itself
        outputs = first
        for turn in range(s.max_turns):
            live = [row for row in rows if row.live]
            if turn > 0:
                live, outputs = self._continue(live, sampling, stop, per_turn, context, turn)
            calling = [row for row, out in zip(live, outputs) if self._take_turn(row, out, last=turn == s.max_turns - 1)]
            self._run_tools(calling)
            if not any(row.live for row in rows):
                break
        return [self._completion(row) for row in rows]

    def _continue(self, live: list["_Row"], sampling: SamplingConfig, stop: list[str], per_turn: int,
                  context: int | None, turn: int) -> tuple[list["_Row"], list[Completion]]:
        """The next turn of the live rows: ``engine.generate`` over their whole prefixes, ``n = 1``. A call takes one
        ``max_new_tokens``, the largest live row's own limit (each row is cut to its own in ``_take_turn``). An
        engine with a ``context_length`` (the hf engine: the model's ``max_position_embeddings``) refuses a call
        whose longest prefix plus ``max_new_tokens`` passes it, though each row's prefix plus its own limit fits
        (preflight checks ``data.prompt_length + algorithm.response_length``): there the rows, longest prefix first,
        are split into as few calls as stay within it. vLLM checks the prompt alone and stops a sequence at its
        ``max_model_len``: one call. Each call's seed is derived from the turn, and from the call's index when there
        are several. Returns the rows in call order and their completions."""
        limit = {id(row): min(per_turn, self.settings.max_response_tokens - len(row.response_ids)) for row in live}
        order = sorted(live, key=lambda row: -len(row.prompt_ids) - len(row.response_ids))
        calls: list[list[_Row]] = []
        longest = largest_limit = 0  # of the last call: its first row's prefix (the longest), its rows' largest limit
        for row in order:
            if calls and (context is None or longest + max(largest_limit, limit[id(row)]) <= context):
                calls[-1].append(row)
                largest_limit = max(largest_limit, limit[id(row)])
                continue
            calls.append([row])
            longest, largest_limit = len(row.prompt_ids) + len(row.response_ids), limit[id(row)]
        position = {id(row): index for index, row in enumerate(live)}
        rows, outputs = [], []
        for index, group in enumerate(calls):
            group.sort(key=lambda row: position[id(row)])  # each call's rows in the loop's order
            seed = derive_seed(sampling.seed, turn) if len(calls) == 1 else derive_seed(sampling.seed, turn, index)
            caches = [row.cache for row in group]
            for row in group:
                row.cache = None  # the engine frees each once it is in a batch cache
            group_outputs, kept = self._generate(
                [row.prompt_ids + row.response_ids for row in group],
                dataclasses.replace(sampling, n=1, seed=seed, stop=stop,
                                    max_new_tokens=max(limit[id(row)] for row in group)),
                caches, keep=turn < self.settings.max_turns - 1)
            for row, cache in zip(group, kept):
                row.cache = cache
            outputs += group_outputs
            rows += group
        return rows, outputs

    def _generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, caches: list | None = None, *,
                  keep: bool) -> tuple[list[Completion], list]:
        """The engine's completions and the caches it kept (all None where it keeps none; ``keep``: a later turn
        may follow)."""
        if self.continues_kv:
            return self.engine.generate_with_caches(prompt_ids, sampling, caches, keep=keep)
        outputs = self.engine.generate(prompt_ids, sampling)
        return outputs, [None] * len(outputs)

    # ------------------------------------------------------------------------- one turn
    def _take_turn(self, row: _Row, out: Completion, *, last: bool) -> bool:
        """Append the policy's turn to ``row``; True when it ended in a call that is to be run."""
        s = self.settings
        budget = s.max_response_tokens - len(row.response_ids)
        ids, logprobs, reason = list(out.response_ids), list(out.response_logprobs), out.finish_reason
        if len(ids) > budget:  # the call's limit is the largest live row's budget: cut this row's to its own
            ids, logprobs, reason = ids[:budget], logprobs[:budget], "length"
        text = decode_response(self.tokenizer, ids) if len(ids) != len(out.response_ids) else out.text
        start = len(row.response_ids)
        row.add(ids, logprobs, 1)
        row.finish_reason = reason
        if reason == "stop" and ends_in_call(text, s.format):
            ended = "max_turns" if last else "tool_call"
        elif reason == "length":
            ended = "length"
        else:
            ended = "answer" if final_answer_end(text) is not None else "void"
        row.turns.append(TurnRecord(start=start, end=len(row.response_ids), ended=ended))
        row.live = ended == "tool_call"
        if not row.live:
            row.cache = None
        return row.live

    def _run_tools(self, rows: list[_Row]) -> None:
        """Run the calls of ``rows`` (one per row) at once, then append each row's tool turn."""
        if not rows:
            return
        parsed = []
        for row in rows:
            turn = row.turns[-1]
            turn_text = decode_response(self.tokenizer, row.response_ids[turn.start:turn.end])
            parsed.append((turn_text, parse_turn(turn_text, self.settings.format)))
        calls = [p.call for _, p in parsed if p.call is not None]
        kwargs = [row.kwargs.get(p.call.name, {}) for row, (_, p) in zip(rows, parsed) if p.call is not None]
        started = time.perf_counter()
        results = iter(self.toolset.run(calls, kwargs) if calls else [])
        self.tool_seconds += time.perf_counter() - started
        for row, (turn_text, p) in zip(rows, parsed):
            if p.call is None:
                record, content = ToolCallRecord("", {}, error=INVALID_CALL), p.error
            else:
                result = next(results)
                record = ToolCallRecord(p.call.name, dict(p.call.arguments), error=result.error,
                                        seconds=float(result.seconds), reward=result.reward)
                content = result.content
            turn = row.turns[-1]
            turn.calls.append(record)
            capped = cap_tool_output(content, self.tokenizer, self.settings.max_tool_response_tokens,
                                     self.settings.tool_response_truncate_side)
            record.content = capped
            ids = self.tokenizer.encode(self.tool_turns.text([capped], turn_text), add_special_tokens=False)
            if len(row.response_ids) + len(ids) + 1 > self.settings.max_response_tokens:
                row.live, row.finish_reason, row.cache = False, "length", None  # no room to answer: not appended
                continue
            row.add(ids, [0.0] * len(ids), 0)
            turn.tool_end = len(row.response_ids)

    def _completion(self, row: _Row) -> Completion:
        return Completion(
            prompt_index=row.prompt_index, prompt_ids=row.prompt_ids, response_ids=row.response_ids,
            response_logprobs=row.logprobs, text=decode_response(self.tokenizer, row.response_ids),
            finish_reason=row.finish_reason, response_mask=row.mask, turns=row.turns)

    # ------------------------------------------------------------------------- continuing a rollout
    def continue_rollouts(self, prefixes: Sequence[Completion], sampling: SamplingConfig,
                          tool_kwargs: Sequence[Mapping[str, Any]] | None = None, *,
                          max_new_turns: int | None = None) -> list[Completion]:
        """``sampling.n`` continuations of each prefix, grouped contiguously like ``generate``'s (Monte-Carlo
        labels of turn prefixes, ``prm.turn_labeling``; the tree by turns, ``grpo_mega.stages.turn_tree``). A
        prefix is a multi-turn completion cut right after a tool turn: its response through its last turn's
        ``tool_end``, its turns through that one; or an empty response without turns (the prompt alone: the loop
        starts at its first turn). The loop goes on from the next turn as if it had sampled the prefix itself: the
        prefix's turns count towards ``max_turns`` and its tokens towards the response budget. Each continuation is
        the whole completion, the prefix's tokens, log-probs, mask and turns first. Call ``i`` of the loop samples
        with ``derive_seed(seed, i)``. ``max_new_turns``: stop after that many more assistant turns (a rollout still
        going then ends with its last tool turn, ``finish_reason`` "stop", a prefix this method can continue);
        None: run to the end."""
        s = self.settings
        rows = []
        for index, prefix in enumerate(prefixes):
            turns = prefix.turns or []
            if not turns and not prefix.response_ids:
                pass  # the prompt alone
            elif not turns or turns[-1].tool_end != len(prefix.response_ids) or len(turns) >= s.max_turns:
                raise ValueError(f"continue_rollouts: prefix {index} does not end with a tool turn within "
                                 f"max_turns={s.max_turns} (turns: {len(turns)})")
            kwargs = (tool_kwargs[index] if tool_kwargs is not None else None) or {}
            for _ in range(sampling.n):
                rows.append(_Row(index, list(prefix.prompt_ids), kwargs, list(prefix.response_ids),
                                 list(prefix.response_logprobs), list(prefix.policy_mask),
                                 [dataclasses.replace(t, calls=list(t.calls)) for t in turns], "stop"))
        stop = list(sampling.stop) + [x for x in STOP_STRINGS[s.format] if x not in sampling.stop]
        per_turn = min(s.max_tokens_per_turn or s.max_response_tokens, s.max_response_tokens)
        context = getattr(self.engine, "context_length", None)
        call = 0
        while any(row.live for row in rows) and (max_new_turns is None or call < max_new_turns):
            call += 1
            live, outputs = self._continue([row for row in rows if row.live], sampling, stop, per_turn, context, call)
            self._run_tools([row for row, out in zip(live, outputs)
                             if self._take_turn(row, out, last=len(row.turns) == s.max_turns - 1)])
        return [self._completion(row) for row in rows]
