"""The step baseline (``algorithm.step_baseline``) and the step-count leak it closes, on hand-built groups.

A completion's summed credit is its first token's advantage: the sum (``step_credit: sum``) or minimum (``min``) of
its steps' normalised rewards. The invariant: adding a correct-but-useless step before the answer (a step that
changes no value: the PRM's, the tree's or the oracle's estimate of success after it equals the estimate before it),
or splitting one step in two, never raises it. Each source's step scores are values in [0, 1] that
``process_reward.step_reward`` turns into rewards; the sources differ in where the values come from, so each builds
its useless step the way it would score one.
"""

import itertools

import pytest
import torch

from grpo_mega.algo import path_values, process_advantages, step_rewards_from_scores, tree_node_values

G = 4
ETA = 0.5


def advantages(rows_rewards, *, baseline, credit="sum", scale_by_std=True):
    """[rows, T] advantages of one group whose completion i has step rewards ``rows_rewards[i]``, one token a step
    (step j ends at token j)."""
    width = max(len(r) for r in rows_rewards)
    rewards = torch.zeros(len(rows_rewards), width)
    ends = torch.full((len(rows_rewards), width), -1, dtype=torch.long)
    for i, row in enumerate(rows_rewards):
        rewards[i, :len(row)] = torch.tensor(row)
        ends[i, :len(row)] = torch.arange(len(row))
    mask = torch.ones(len(rows_rewards), width)
    return process_advantages(rewards, ends, mask, len(rows_rewards), baseline=baseline, credit=credit,
                              scale_by_std=scale_by_std)


def summed_credit(rows_values, starts, *, kind, baseline, credit):
    """Completion 0's summed credit: its first token's advantage, from the rows' step values (scores)."""
    rows = [step_rewards_from_scores(v, kind, start=s, clip_eta=ETA) for v, s in zip(rows_values, starts)]
    return float(advantages(rows, baseline=baseline, credit=credit)[0, 0])


# One group's step values (scores) per source, completion 0 the one that is padded or split. The values are what
# each source would score: a learned PRM's and the tree's estimates of success after each step, the oracle's "all
# steps so far right" (1 or 0), the implicit PRM's sigmoid of its summed rewards (implicit_prm.step_value:
# probability). The last value is the answer's (outcome 1 or 0).
GROUPS = {
    "learned_prm": [[0.7, 0.8, 0.9, 1.0], [0.6, 0.3, 0.1, 0.0], [0.5, 0.6, 0.0], [0.8, 0.9, 1.0]],
    "implicit_prm": [[0.55, 0.6, 0.7, 0.9], [0.5, 0.45, 0.2, 0.1], [0.6, 0.4, 0.3], [0.52, 0.7, 0.8]],
    "oracle": [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
    "tree": None,  # made from a tree's outcomes below
}
# A tree [2, 2] of 4 leaves: leaves 0 and 1 share node 0, leaves 2 and 3 share node 1; outcomes 1, 0, 0, 0.
TREE_PATHS = [[0, 2], [0, 3], [1, 4], [1, 5]]
TREE_OUTCOMES = [1.0, 0.0, 0.0, 0.0]
GROUPS["tree"] = path_values(TREE_PATHS, TREE_OUTCOMES)


def starts_of(values):
    """s_0 of ``progress``: the group's mean outcome (each row's last value)."""
    mean = sum(v[-1] for v in values) / len(values)
    return [mean] * len(values)


def padded(values, where):
    """Completion 0 with a useless step inserted after its step ``where``: its value repeats the value before it."""
    row = list(values[0])
    return [row[:where + 1] + [row[where]] + row[where + 1:], *values[1:]]


def split(values, where, middle):
    """Completion 0 with its step ``where`` split in two, the first half scored ``middle``."""
    row = list(values[0])
    return [row[:where] + [middle] + row[where:], *values[1:]]


# score + sum credit pays for every step by construction (DeepSeekMath's form: the suffix sum of values grows with
# the number of steps); every other combination must hold the invariant under the completion baseline. delta + sum
# credits a token with the value its step reaches, so a split whose first half reaches a higher value than the whole
# step does raises the tokens before it (the split's own merit, not its count): it is held to the useless step only.
CASES = [(source, kind, credit) for source, kind, credit in
         itertools.product(GROUPS, ("score", "progress", "delta", "clip"), ("sum", "min"))
         if not (kind == "score" and credit == "sum")]


@pytest.mark.parametrize("source,kind,credit", CASES)
def test_a_useless_step_or_a_split_never_raises_a_completions_credit_under_the_completion_baseline(source, kind,
                                                                                                    credit):
    values = GROUPS[source]
    starts = starts_of(values)
    before = summed_credit(values, starts, kind=kind, baseline="completion", credit=credit)
    answer = len(values[0]) - 1
    variants = [padded(values, where) for where in range(answer)]  # before the answer
    variants += [padded(padded(values, where), where) for where in range(answer)]  # two of them
    if not (kind == "delta" and credit == "sum"):
        variants += [split(values, where, middle) for where in range(answer) for middle in (0.0, 0.3, 0.95, 1.0)]
    for variant in variants:
        after = summed_credit(variant, starts_of(variant), kind=kind, baseline="completion", credit=credit)
        assert after <= before + 1e-6, (variant[0], before, after)


def test_delta_credits_the_value_a_split_reaches():
    """What the invariant leaves out for delta + sum: the completion's credit is the value after its first step, so a
    first half scored above the whole first step raises it, under either baseline."""
    values = GROUPS["learned_prm"]
    for baseline in ("completion", "pooled_steps"):
        before = summed_credit(values, starts_of(values), kind="delta", baseline=baseline, credit="sum")
        after = summed_credit(split(values, 0, 0.95), starts_of(values), kind="delta", baseline=baseline, credit="sum")
        assert after > before


def test_the_pooled_baseline_pays_for_a_useless_step_under_clip():
    """The leak of DeepSeekMath's pooled per-step normalisation: clip's rewards are <= 0, the pooled mean is negative,
    and a 0-reward step (a correct step, score above eta) normalises to a positive credit; each one adds
    |mean| / std to the completion's summed credit."""
    values = GROUPS["learned_prm"]
    starts = starts_of(values)
    before = summed_credit(values, starts, kind="clip", baseline="pooled_steps", credit="sum")
    after = summed_credit(padded(values, 1), starts, kind="clip", baseline="pooled_steps", credit="sum")
    more = summed_credit(padded(padded(values, 1), 1), starts, kind="clip", baseline="pooled_steps", credit="sum")
    assert after > before + 0.1 and more > after + 0.1
    fixed = summed_credit(padded(values, 1), starts, kind="clip", baseline="completion", credit="sum")
    assert fixed == pytest.approx(summed_credit(values, starts, kind="clip", baseline="completion", credit="sum"))


def test_the_pooled_baseline_pays_for_a_useless_step_under_progress_and_score():
    """The same leak with a telescoping form: progress rewards of a mostly wrong group have a negative pooled mean."""
    values = GROUPS["oracle"]
    starts = starts_of(values)
    for kind in ("progress", "score"):
        before = summed_credit(values, starts, kind=kind, baseline="pooled_steps", credit="sum")
        after = summed_credit(padded(values, 0), starts, kind=kind, baseline="pooled_steps", credit="sum")
        assert after > before + 0.05, kind


def test_the_completion_baseline_by_hand():
    """Returns C = (1.0, 0.2); b = 0.6, std = 0.5657; a token's advantage is (C_i(t) - b) / std."""
    got = advantages([[0.5, 0.5], [0.2, 0.0]], baseline="completion")
    std = (0.32 ** 0.5)
    assert got[0].tolist() == pytest.approx([0.4 / std, -0.1 / std], abs=1e-5)
    assert got[1].tolist() == pytest.approx([-0.4 / std, -0.6 / std], abs=1e-5)
    # min credit: returns min(0.5, 0.5) = 0.5 and 0.0; b = 0.25
    got_min = advantages([[0.5, 0.5], [0.2, 0.0]], baseline="completion", credit="min")
    std_min = (0.125 ** 0.5)
    assert got_min[1].tolist() == pytest.approx([-0.25 / std_min, -0.25 / std_min], abs=1e-5)
    # Dr. GRPO: no scaling
    assert advantages([[0.5, 0.5], [0.2, 0.0]], baseline="completion", scale_by_std=False)[0].tolist() == \
        pytest.approx([0.4, -0.1], abs=1e-6)


def test_the_completion_baselines_std_has_a_floor():
    """Returns that nearly agree (every answer right) divide by step_baseline_min_std, not by their tiny spread."""
    rows = [[0.2, 1.0], [0.21, 1.0]]
    got = advantages(rows, baseline="completion")
    # returns 1.2 and 1.21: b = 1.205, std 0.00707 < 0.25
    assert float(got[0, 1]) == pytest.approx((1.0 - 1.205) / 0.25, abs=1e-4)


def test_tree_values_are_the_mean_outcome_below_each_node():
    # [2, 2] tree; leaf 1's node ended early, so its completion fills two rows (paths [0] twice)
    paths = [[0], [0], [1, 2], [1, 3]]
    values = tree_node_values(paths, [1.0, 1.0, 0.0, 1.0])
    assert values == {0: 1.0, 1: 0.5, 2: 0.0, 3: 1.0}
    assert path_values(paths, [1.0, 1.0, 0.0, 1.0]) == [[1.0], [1.0], [0.5, 0.0], [0.5, 1.0]]
    with pytest.raises(ValueError, match="2 tree paths but 1 outcomes"):
        tree_node_values(paths[:2], [1.0])


def test_tree_progress_credit_is_the_outcome_minus_the_parents_value():
    """VinePPO's advantage: under progress with the completion baseline a token of segment k gets
    (o_i - V(parent of k)) / std(o), the root's value being the group's mean outcome."""
    values = path_values(TREE_PATHS, TREE_OUTCOMES)  # [[0.5, 1], [0.5, 0], [0, 0], [0, 0]]
    rows = [step_rewards_from_scores(v, "progress", start=0.25) for v in values]
    got = advantages(rows, baseline="completion")
    std = torch.tensor(TREE_OUTCOMES).std().item()
    assert got[0].tolist() == pytest.approx([(1 - 0.25) / std, (1 - 0.5) / std], abs=1e-5)
    assert got[1].tolist() == pytest.approx([(0 - 0.25) / std, (0 - 0.5) / std], abs=1e-5)
    assert got[2].tolist() == pytest.approx([(0 - 0.25) / std, 0.0], abs=1e-5)
