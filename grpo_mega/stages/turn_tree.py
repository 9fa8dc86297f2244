"""Tree credit by turns (``process_reward.source: tree`` with ``process_reward.steps: turns`` and
``rollout.multi_turn.enable``): the tree of ``grpo_mega.stages.tree_rollout`` whose branch points are turn
boundaries instead of fixed token counts, so no branch cuts through a policy turn or a tool's output.

Sampling (:class:`TurnTreeSampler`): a node is one assistant turn and the tool turn that answered it. Level 0
samples ``tree_rollout.branching[0]`` first turns from each prompt; level l continues every node of level l - 1
that ended in a call whose tool turn was appended (the point where the policy is asked for its next turn) with
``branching[l]`` next turns; the last level's continuations run through the turn loop to the end (an answer, a
void turn, ``rollout.multi_turn.max_turns``, the per-turn limit or ``algorithm.response_length``, tool turns
included: a continuation is the turn loop's ``continue_rollouts`` of its node's whole conversation, so the node's
turns count towards ``max_turns`` and its tokens towards the budget). ``tree_rollout.segment_tokens`` plays no
part: a segment is a turn. As in the text tree, a node that ends before the last level (its answer, a void turn, a
limit) is a leaf standing for its whole subtree: its completion fills ``prod(branching[l + 1:])`` rows, so a group
is always G = prod(branching) rows, in depth-first order, and every row is a training sample (the leaves are the
completions; a node's shared prefix is trained once per row below it). Level l is one ``generate_across_ranks``
call with a seed derived from the step's call seed and l, so a resumed run samples the same tree.

Step rewards (:class:`TurnTreeRewards`): each turn step of a row (``grpo_mega.stages.turn_steps``) is scored by the
Monte-Carlo value of the node it lies in (``grpo_mega.algo.turn_node_values``: the mean outcome of the rows below
that node; every turn of the last node, the row's own outcome), shaped by ``process_reward.step_reward`` as the
text tree's segments are (``progress``: the value the turn added, s_0 the group's mean outcome), and handed to
``algorithm.turn_credit`` like every turn source's rewards.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from grpo_mega.algo import path_values, turn_node_values
from grpo_mega.config import ProcessRewardConfig
from grpo_mega.rollout.base import Completion, SamplingConfig, derive_seed
from grpo_mega.rollout.distributed import generate_across_ranks
from grpo_mega.rollout.turn_metrics import turn_metrics
from grpo_mega.stages.process_reward import shape_step_rewards, step_reward_starts
from grpo_mega.stages.tree_rollout import BranchingSampler
from grpo_mega.stages.turn_steps import step_turns, turn_step_ends


@dataclass
class _TurnNode:
    """One node of the tree: the conversation through its last turn (and tool turn, if it goes on)."""

    prompt: int
    level: int
    completion: Completion
    path: list[int] = field(default_factory=list)
    children: list["_TurnNode"] = field(default_factory=list)


def continues(completion: Completion, max_turns: int) -> bool:
    """Whether a node's conversation waits for the policy's next turn: its last turn ended in a call, the tool turn
    was appended and ends the response, and ``max_turns`` leaves a turn."""
    turns = completion.turns or []
    return (bool(turns) and turns[-1].ended == "tool_call" and turns[-1].tool_end == len(completion.response_ids)
            and len(turns) < max_turns)


class _FromPrefixes:
    """The engine ``generate_across_ranks`` drives for one level: given a node's tokens (prompt and response so far)
    as a prompt, its ``generate`` is the turn loop's ``continue_rollouts`` of that node (``max_new_turns``: one
    turn, or None at the last level); identical tokens are one conversation. Replica layout and the rest: the
    loop's."""

    def __init__(self, loop, prefixes: Sequence[Completion], max_new_turns: int | None):
        self.loop, self.max_new_turns = loop, max_new_turns
        self.prefixes = {tuple(p.prompt_ids + p.response_ids): p for p in prefixes}

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loop"], name)

    def generate(self, prompt_ids, sampling, tool_kwargs=None):
        return self.loop.continue_rollouts([self.prefixes[tuple(ids)] for ids in prompt_ids], sampling, tool_kwargs,
                                           max_new_turns=self.max_new_turns)


class TurnTreeSampler(BranchingSampler):
    """Samples each prompt's group as a tree branching at turn boundaries (module docstring); collective, like
    ``generate_across_ranks``. ``engine``: the turn loop (``grpo_mega.rollout.turn_loop.TurnLoopEngine``)."""

    def __init__(self, branching: Sequence[int], max_turns: int, decode: Callable[[list[int]], str]) -> None:
        super().__init__(branching, decode)
        self.max_turns = int(max_turns)

    def generate(self, engine, prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *, call_seed: int,
                 tool_kwargs: Sequence[Mapping[str, Any]] | None = None) -> list[Completion]:
        """G = prod(branching) multi-turn completions per prompt, grouped contiguously (``sampling.n`` is ignored),
        each with ``tree_path`` (its nodes' ids, unique within the group) and ``segment_ends`` (the response index
        of the last token of each earlier node: the end of the tool turn it branched after)."""
        if not hasattr(engine, "continue_rollouts"):
            raise ValueError("process_reward.source=tree with process_reward.steps=turns samples through the turn "
                             "loop (rollout.multi_turn.enable=true); this engine has no continue_rollouts")
        start = time.perf_counter()
        roots = [_TurnNode(p, -1, Completion(p, list(ids), [], [], "", "stop", response_mask=[], turns=[]))
                 for p, ids in enumerate(prompt_ids)]
        counters = [0] * len(prompt_ids)
        frontier, generated, nodes = list(roots), 0, 0
        for level, children in enumerate(self.branching):
            last = level == len(self.branching) - 1
            prefixes = [node.completion for node in frontier]
            outputs = generate_across_ranks(
                _FromPrefixes(engine, prefixes, None if last else 1), [p.prompt_ids + p.response_ids for p in prefixes],
                dataclasses.replace(sampling, n=children), call_seed=derive_seed(call_seed, level),
                tool_kwargs=[(tool_kwargs[n.prompt] if tool_kwargs is not None else None) or {} for n in frontier])
            next_frontier = []
            for index, parent in enumerate(frontier):
                for out in outputs[index * children:(index + 1) * children]:
                    out.prompt_index = parent.prompt
                    child = _TurnNode(parent.prompt, level, out, parent.path + [counters[parent.prompt]])
                    counters[parent.prompt] += 1
                    parent.children.append(child)
                    generated += sum(out.policy_mask[len(parent.completion.response_ids):])  # its own tokens once
                    nodes += 1
                    if not last and continues(out, self.max_turns):
                        next_frontier.append(child)
            frontier = next_frontier
            if not frontier:
                break
        completions, depths = [], []
        for root in roots:
            for leaf, ancestors in _leaves(root, []):
                depths.append(leaf.level + 1)
                ends = [len(node.completion.response_ids) - 1 for node in ancestors]
                completions += [_copy(leaf.completion, leaf.path, ends)
                                for _ in range(self.rows_of_leaf(leaf.level))]
        tool_seconds = engine.pop_tool_seconds() if hasattr(engine, "pop_tool_seconds") else 0.0
        self.metrics = {
            **turn_metrics(completions),
            "timing_s/tools": tool_seconds,
            **self.tree_metrics(generated, nodes, depths, start),
        }
        return completions


def _leaves(node: _TurnNode, ancestors: list[_TurnNode]):
    """(leaf, its ancestors below the root) under ``node``, depth-first."""
    for child in node.children:
        if child.children:
            yield from _leaves(child, ancestors + [child])
        else:
            yield child, ancestors


def _copy(completion: Completion, path: list[int], ends: list[int]) -> Completion:
    """One row of a leaf: its own lists and turn records (rows of one leaf are separate samples)."""
    return dataclasses.replace(
        completion, prompt_ids=list(completion.prompt_ids), response_ids=list(completion.response_ids),
        response_logprobs=list(completion.response_logprobs), response_mask=list(completion.policy_mask),
        turns=[dataclasses.replace(t, calls=list(t.calls)) for t in completion.turns or []], tree_path=list(path),
        segment_ends=list(ends))


class TurnTreeRewards:
    """The step-reward source of ``process_reward.source: tree`` with ``steps: turns``: carries the
    :class:`TurnTreeSampler` the rollout stage samples with, and scores each row's turn steps by the values of the
    nodes they lie in (module docstring)."""

    def __init__(self, sampler: TurnTreeSampler, settings: ProcessRewardConfig) -> None:
        self.sampler = sampler
        self.settings = settings

    def __call__(self, prompts: Sequence[str], texts: Sequence[str], outcomes: Sequence[float],
                 rows_extra: Sequence[dict], *, completions: Sequence[Completion] | None = None):
        """(rewards per turn step, step ends as response token indices, metrics) of every row; ``completions``: the
        rows the :class:`TurnTreeSampler` made, in its order (groups of G consecutive rows)."""
        if completions is None or any(c.tree_path is None or c.turns is None for c in completions):
            raise ValueError("process_reward.source=tree with steps=turns scores the rows its TurnTreeSampler "
                             "sampled (tree_path and turns on every completion); these came from another sampler")
        G = self.sampler.leaves
        values: list[list[float]] = []
        for begin in range(0, len(completions), G):
            values += path_values([c.tree_path for c in completions[begin:begin + G]], outcomes[begin:begin + G])
        starts = step_reward_starts(self.settings, prompts, outcomes)
        rewards, branched = [], []
        for completion, row_values, outcome, s0 in zip(completions, values, outcomes, starts):
            turn_values = turn_node_values(row_values, completion.segment_ends,
                                           [turn.start for turn in step_turns(completion)])
            rewards.append(shape_step_rewards(turn_values, outcome, self.settings, start=s0))
            branched.append(len(row_values) - 1)
        inner = [v for row in values for v in row[:-1]]
        metrics = {"tree/steps_per_completion": sum(map(len, rewards)) / max(len(rewards), 1),
                   "tree/branched_turns_per_completion": sum(branched) / max(len(branched), 1),
                   "tree/value_mean": sum(inner) / max(len(inner), 1)}
        return rewards, [turn_step_ends(c) for c in completions], metrics
