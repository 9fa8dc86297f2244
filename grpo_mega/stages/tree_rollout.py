"""Tree credit (``process_reward.source: tree``): a group is sampled as a tree and each segment's step score is the
Monte-Carlo value of its node, the mean outcome of the completions below it (VinePPO's value estimate, SPO-tree's
fixed-length segments, TreeRPO's tree). No reward model and no labels: the policy's own samples are the estimate.

Sampling (:class:`TreeSampler`): level 0 samples ``branching[0]`` segments of ``segment_tokens`` tokens from each
prompt; level l continues every unfinished node of level l - 1 with ``branching[l]`` segments from ``prompt +
prefix`` token ids (no re-tokenisation); the last level's segments run to the end (end of sequence, a stop string
or ``algorithm.response_length``). A node that ends before the last level is a leaf standing for its whole subtree:
its completion fills ``prod(branching[l + 1:])`` rows, so the group is always G = prod(branching) rows, in
depth-first order, and a shared prefix is trained once per row below it (each row is one draw of the tree's sampling
distribution, as G independent chains would be). Every level is one ``generate_across_ranks`` call with a seed
derived from the step's call seed and the level, so a resumed run samples the same tree.

Step rewards (:class:`TreeStepRewards`): a row's steps end at its segments' ends, each scored by its node's value
(``grpo_mega.algo.tree_values``; the last, the row's outcome), the answer guard cuts them at the first final answer,
and ``process_reward.step_reward`` turns the values into rewards as for a PRM's scores: ``progress`` gives the
value a segment added (its suffix sum from segment k is ``o_i - V(parent of k)``: VinePPO's advantage), ``delta``
the value of the node a token's segment reaches, ``score`` the values themselves. s_0 of ``progress`` is the group's
mean outcome: the root's value.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from grpo_mega.algo import path_values
from grpo_mega.config import ProcessRewardConfig
from grpo_mega.rollout.base import Completion, RolloutEngine, SamplingConfig, derive_seed
from grpo_mega.rollout.distributed import generate_across_ranks
from grpo_mega.stages.answer_guard import AnswerGuard
from grpo_mega.stages.process_reward import shape_step_rewards, step_reward_starts


@dataclass
class _Node:
    """One segment of the tree, with the whole response up to its end."""

    prompt: int
    level: int
    node_id: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    path: list[int] = field(default_factory=list)
    children: list["_Node"] = field(default_factory=list)


class BranchingSampler:
    """What every tree sampler shares, whatever a node is (a fixed-length segment here, a turn in
    ``grpo_mega.stages.turn_tree``): the branching per level, the group size it makes, how a leaf that ends early
    fills its subtree's rows, the decoder, and the shape of the tree's metrics. The sampling itself is each
    subclass's ``generate``."""

    def __init__(self, branching: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self.branching = [int(b) for b in branching]
        self.decode = decode
        self.metrics: dict[str, float] = {}

    @property
    def leaves(self) -> int:
        """G: the rows of one prompt's group."""
        return math.prod(self.branching)

    def rows_of_leaf(self, level: int) -> int:
        """How many rows a leaf at ``level`` fills: its whole subtree's, ``prod(branching[level + 1:])``."""
        return math.prod(self.branching[level + 1:])

    @staticmethod
    def tree_metrics(generated: int, nodes: int, depths: Sequence[int], start: float) -> dict[str, float]:
        """The ``rollout/tree/*`` metrics of one sampling call that began at ``perf_counter()`` ``start``;
        ``depths``: each leaf's level + 1."""
        return {
            "rollout/tree/generated_tokens": float(generated),
            "rollout/tree/nodes": float(nodes),
            "rollout/tree/leaves": float(len(depths)),
            "rollout/tree/mean_depth": sum(depths) / max(len(depths), 1),
            "timing_s/tree_sampling": time.perf_counter() - start,
        }


class TreeSampler(BranchingSampler):
    """Samples each prompt's group as a tree (module docstring); collective, like ``generate_across_ranks``."""

    def __init__(self, branching: Sequence[int], segment_tokens: int, decode: Callable[[list[int]], str]) -> None:
        super().__init__(branching, decode)
        self.segment_tokens = int(segment_tokens)

    def generate(self, engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 call_seed: int) -> list[Completion]:
        """G = prod(branching) completions per prompt, grouped contiguously as ``generate_across_ranks`` returns
        them (``sampling.n`` is ignored: the branching sets the group), each with ``tree_path`` (its nodes' ids,
        unique within the group) and ``segment_ends`` (the response index of each earlier segment's last token)."""
        start = time.perf_counter()
        roots = [_Node(prompt, -1, -1) for prompt in range(len(prompt_ids))]
        counters = [0] * len(prompt_ids)
        frontier, generated, nodes = list(roots), 0, 0
        budget = sampling.max_new_tokens
        for level, children in enumerate(self.branching):
            last = level == len(self.branching) - 1
            used = level * self.segment_tokens  # every open node holds exactly this many tokens
            level_sampling = dataclasses.replace(
                sampling, n=children, max_new_tokens=budget - used if last else min(self.segment_tokens, budget - used))
            requests = [list(prompt_ids[node.prompt]) + node.response_ids for node in frontier]
            outputs = generate_across_ranks(engine, requests, level_sampling, call_seed=derive_seed(call_seed, level))
            next_frontier = []
            for index, parent in enumerate(frontier):
                for out in outputs[index * children:(index + 1) * children]:
                    child = _Node(parent.prompt, level, counters[parent.prompt],
                                  parent.response_ids + list(out.response_ids),
                                  parent.logprobs + list(out.response_logprobs), out.finish_reason,
                                  parent.path + [counters[parent.prompt]])
                    counters[parent.prompt] += 1
                    parent.children.append(child)
                    generated += len(out.response_ids)
                    nodes += 1
                    if not last and out.finish_reason == "length" and len(child.response_ids) < budget:
                        next_frontier.append(child)
            frontier = next_frontier
            if not frontier:
                break
        completions, depths = [], []
        for root in roots:
            for leaf in _leaves(root):
                depths.append(leaf.level + 1)
                copies = self.rows_of_leaf(leaf.level)
                text = self.decode(leaf.response_ids)
                ends = [(k + 1) * self.segment_tokens - 1 for k in range(leaf.level)]
                completions += [Completion(root.prompt, list(prompt_ids[root.prompt]), list(leaf.response_ids),
                                           list(leaf.logprobs), text, leaf.finish_reason, tree_path=list(leaf.path),
                                           segment_ends=list(ends)) for _ in range(copies)]
        self.metrics = self.tree_metrics(generated, nodes, depths, start)
        return completions


def _leaves(node: _Node):
    """The leaves under ``node`` in depth-first order."""
    for child in node.children:
        if child.children:
            yield from _leaves(child)
        else:
            yield child


class TreeStepRewards:
    """The step-reward source of ``process_reward.source: tree``: carries the :class:`TreeSampler` the rollout stage
    samples with, and scores each row's segments by their nodes' values (module docstring)."""

    def __init__(self, sampler: TreeSampler, settings: ProcessRewardConfig,
                 answer_guard: AnswerGuard | None = None) -> None:
        self.sampler = sampler
        self.settings = settings
        self.answer_guard = answer_guard

    def __call__(self, prompts: Sequence[str], texts: Sequence[str], outcomes: Sequence[float],
                 rows_extra: Sequence[dict], *, completions: Sequence[Completion] | None = None
                 ) -> tuple[list[list[float]], list[list[int]], dict[str, float]]:
        """(step rewards, step ends as character offsets, metrics) of every row; ``completions``: the rows the
        :class:`TreeSampler` made, in its order (groups of G consecutive rows)."""
        if completions is None or any(c.tree_path is None for c in completions):
            raise ValueError("process_reward.source=tree scores the rows its TreeSampler sampled (tree_path and "
                             "segment_ends on every completion); these came from another sampler")
        G = self.sampler.leaves
        values: list[list[float]] = []
        for begin in range(0, len(completions), G):
            group = completions[begin:begin + G]
            values += path_values([c.tree_path for c in group], outcomes[begin:begin + G])
        starts = step_reward_starts(self.settings, prompts, outcomes)
        rewards, ends = [], []
        for completion, text, row_values, outcome, start in zip(completions, texts, values, outcomes, starts):
            row_values, row_ends = self._segments(completion, text, row_values)
            rewards.append(shape_step_rewards(row_values, outcome, self.settings, start=start))
            ends.append(row_ends)
        steps = [len(row) for row in ends]
        return rewards, ends, {"tree/steps_per_completion": sum(steps) / max(len(steps), 1),
                               "tree/value_mean": sum(v for row in values for v in row[:-1]) /
                               max(sum(len(row) - 1 for row in values), 1)}

    def _segments(self, completion: Completion, text: str, values: list[float]) -> tuple[list[float], list[int]]:
        """A row's step values and character ends: each segment's end in the text (a segment whose tokens decode
        to nothing new merges into the next), cut by the answer guard."""
        ids = completion.response_ids
        step_values, step_ends = [], []
        for value, token_end in zip(values, [*completion.segment_ends, len(ids) - 1]):
            char_end = len(text) if token_end == len(ids) - 1 else len(self.sampler.decode(ids[:token_end + 1]))
            if step_ends and char_end <= step_ends[-1]:
                step_values[-1] = value
                continue
            step_values.append(value)
            step_ends.append(char_end)
        if self.answer_guard is not None:
            step_values, step_ends = self.answer_guard.guard(step_values, step_ends, text,
                                                             self.answer_guard.answer_end(text))
        return step_values, step_ends
