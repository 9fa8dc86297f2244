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
