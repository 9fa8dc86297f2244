"""Monte-Carlo values of a sampling tree's nodes (``process_reward.source: tree``; VinePPO's value estimate with the
tree's own samples).

A group of G completions is sampled as a tree: the prompt is the root, each node is a segment of tokens continuing
its parent's text, and each leaf's path from the root is one completion. A node that ended (end of sequence, a stop
string, the length budget) before the tree's last level stands for all the leaves its subtree would have had, so a
group always has G = prod(branching) rows; such a node's completion appears that many times. A node's value is the
mean outcome of the rows below it:

    V(n) = (1 / |L(n)|) * sum_{i in L(n)} o_i,

``L(n)`` the rows whose path passes through ``n`` and ``o_i`` row i's outcome score. The root's value is the group's
mean outcome (``s_0`` of ``process_reward.step_reward: progress``), a leaf's its own outcome. With equal branching
below a node, V(n) is also the mean of its children's values (TreeRPO's parent value).
"""

from __future__ import annotations

from typing import Sequence


def tree_node_values(paths: Sequence[Sequence[int]], outcomes: Sequence[float]) -> dict[int, float]:
    """{node id: mean outcome of the rows whose path holds it} for one group; ``paths[i]`` lists row i's node ids
    from the root's first child down to its last node (ids unique within the group)."""
    if len(paths) != len(outcomes):
        raise ValueError(f"{len(paths)} tree paths but {len(outcomes)} outcomes")
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for path, outcome in zip(paths, outcomes):
        if not path:
            raise ValueError("a tree path must hold at least one node (the row's last segment)")
        for node in path:
            sums[node] = sums.get(node, 0.0) + float(outcome)
            counts[node] = counts.get(node, 0) + 1
    return {node: sums[node] / counts[node] for node in sums}


def path_values(paths: Sequence[Sequence[int]], outcomes: Sequence[float]) -> list[list[float]]:
    """For each row of one group, the values of the nodes on its path, root side first: the step scores of the row's
    segments (the last one is the value of its last node, the outcome of every row that shares that node)."""
    values = tree_node_values(paths, outcomes)
    return [[values[node] for node in path] for path in paths]


def turn_node_values(row_values: Sequence[float], segment_ends: Sequence[int],
                     turn_starts: Sequence[int]) -> list[float]:
    """The value of each turn of a row of the tree by turns (``process_reward.steps: turns``): the value of the node
    the turn lies in. ``row_values``: the values of the row's nodes, root side first (:func:`path_values`);
    ``segment_ends[j]``: the response index of node j's last token for every node but the last (where the tree
    branched: the end of a tool turn); ``turn_starts``: each turn's first response index, in order. Turn k lies in
    node ``j(k) = #{j : segment_ends[j] < start_k}`` (the first node ending at or after its start), so

        V_turn(k) = row_values[j(k)],

    every turn of the last node (the last level ran to the end) gets the last node's value, the row's outcome."""
    if len(segment_ends) != len(row_values) - 1:
        raise ValueError(f"{len(row_values)} node values need {len(row_values) - 1} segment ends, got "
                         f"{len(segment_ends)}")
    out = []
    for start in turn_starts:
        node = sum(1 for end in segment_ends if end < start)
        out.append(float(row_values[node]))
    return out
