"""Invariants of turn credit (grpo_mega.algo.turn_credit) on hand-built groups, for every form x reward source.

The invariants' quantity is D_i (``turn_term_credit``): the credit the turn term adds to completion i beyond its
outcome advantage, summed over its policy tokens. Where a form fails an invariant the test asserts the failure, so
the table in docs/training.md ("Turn credit") stays true.
"""

from __future__ import annotations

import pytest
import torch

from grpo_mega.algo.turn_credit import (adjusted_outcomes, turn_advantages, turn_tensors, turn_term_credit,
                                        turn_token_index)
from grpo_mega.rollout.base import TurnRecord

TOOL_TOKENS = 2  # tool-output tokens after every turn but the last

# Three reward sources, each a group of 4 completions: (outcome reward, [(turn tokens, turn reward), ...]).
SOURCES = {
    "dense_prm": [(1.0, [(3, 0.9), (2, 0.6)]), (0.0, [(3, 0.3), (2, 0.2)]),
                  (0.0, [(2, 0.5), (2, 0.4), (2, 0.1)]), (1.0, [(4, 0.8)])],
    "sparse_errors": [(1.0, [(3, 0.0), (2, 0.0)]), (0.0, [(3, -1.0), (2, 0.0)]),
                      (0.0, [(2, -1.0), (2, -1.0), (2, 0.0)]), (1.0, [(4, 0.0)])],
    "tool_reward": [(1.0, [(3, 0.5), (2, 1.0)]), (0.0, [(3, -0.5), (2, 0.2)]),
                    (0.0, [(2, 0.1), (2, -0.3), (2, 0.0)]), (1.0, [(4, 0.7)])],
}


def build(group):
    """Tensors of a group: outcomes [B], turn rewards [B, K], spans [B, K, 2], response length T."""
    num_turns = max(len(turns) for _, turns in group)
    lengths = [sum(n for n, _ in turns) + TOOL_TOKENS * (len(turns) - 1) for _, turns in group]
    rewards = torch.zeros(len(group), num_turns)
    spans = torch.full((len(group), num_turns, 2), -1, dtype=torch.long)
    for row, (_, turns) in enumerate(group):
        pos = 0
        for k, (n, r) in enumerate(turns):
            spans[row, k] = torch.tensor([pos, pos + n])
            rewards[row, k] = r
            pos += n + TOOL_TOKENS
    return torch.tensor([o for o, _ in group]), rewards, spans, max(lengths) + 1


def credit(group, form, **kwargs):
    """(advantages [B, T], D [B], spans) of a group under a form."""
    outcomes, rewards, spans, length = build(group)
    adv = turn_advantages(outcomes, rewards, spans, length, len(group), form=form, **kwargs)
    from grpo_mega.algo.advantages import outcome_advantages
    base = outcome_advantages(adjusted_outcomes(outcomes, kwargs.get("answered"),
                                                kwargs.get("stopped_at_max_turns")), len(group))
    return adv, turn_term_credit(adv, spans, base), spans


def duplicate_turn(group, row, k):
    out = [list(t) for _, t in group]
    out[row].insert(k + 1, out[row][k])
    return [(o, t) for (o, _), t in zip(group, out)]


def void_turn(group, row, reward):
    """Completion `row` gets an extra turn (neither a call nor an answer) before its last one, scored `reward`."""
    out = [list(t) for _, t in group]
    out[row].insert(len(out[row]) - 1, (2, reward))
    return [(o, t) for (o, _), t in zip(group, out)]


def split_turn(group, row, k):
    """Turn k of completion `row` cut in two, both halves with the turn's reward (a source scoring each half)."""
    out = [list(t) for _, t in group]
    n, r = out[row][k]
    out[row][k:k + 1] = [(n - n // 2, r), (n // 2, r)]
    return [(o, t) for (o, _), t in zip(group, out)]


# (source, perturbation) pairs where plain `sum` RAISES completion 0's D (the hazard, asserted as such); every other
# pair must not raise it. Completion 0 is a right answer whose turns all sit at or above the pooled mean.
SUM_RAISES = {("dense_prm", "duplicate"), ("dense_prm", "split"), ("sparse_errors", "duplicate"),
              ("sparse_errors", "void"), ("sparse_errors", "split"), ("tool_reward", "duplicate"),
              ("tool_reward", "split"), ("tool_reward", "void")}
VOID_REWARD = {"dense_prm": 0.2, "sparse_errors": 0.0, "tool_reward": 0.0}


def perturbed(source, how):
    group = SOURCES[source]
    if how == "duplicate":
        return duplicate_turn(group, 0, 0)
    if how == "void":
        return void_turn(group, 0, VOID_REWARD[source])
    return split_turn(group, 0, 0)


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("how", ["duplicate", "void", "split"])
@pytest.mark.parametrize("form", ["bounded", "sum"])
def test_extra_void_or_split_turn_never_raises_turn_credit_except_documented(form, source, how):
    _, before, _ = credit(SOURCES[source], form)
    _, after, _ = credit(perturbed(source, how), form)
    if form == "sum" and (source, how) in SUM_RAISES:
        assert after[0] > before[0] + 1e-3, "the documented hazard of `sum` no longer shows: update the table"
    else:
        assert after[0] <= before[0] + 1e-5
    if form == "bounded":  # the turn term only moves credit within a completion
        assert torch.allclose(after, torch.zeros_like(after), atol=1e-5)


def disagreeing(source):
    """The source's group with the turn rewards of the right answer (row 0) and a wrong one (row 1) swapped: the
    turns disagree with the outcomes."""
    group = [list(c) for c in SOURCES[source]]
    (o0, t0), (o1, t1) = group[0], group[1]
    group[0] = (o0, [(n, r) for (n, _), (_, r) in zip(t0, t1)])
    group[1] = (o1, [(n, r) for (n, _), (_, r) in zip(t1, t0)])
    return [tuple(c) for c in group]


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("form", ["bounded", "sum"])
def test_bounded_never_flips_the_outcome_sign_and_tool_tokens_get_zero(form, source):
    for group, turns_disagree in ((SOURCES[source], False), (disagreeing(source), True)):
        adv, _, spans = credit(group, form, weight=5.0)
        token_turn = turn_token_index(spans, adv.shape[1])
        outcomes = build(group)[0]
        sign = torch.sign(outcomes - outcomes.mean()).unsqueeze(1).expand_as(adv)
        assert (adv[token_turn < 0] == 0).all()  # tool tokens and padding: exactly 0
        flipped = (torch.sign(adv) != sign) & (token_turn >= 0)
        if form == "bounded":
            assert not flipped.any()
        elif turns_disagree:  # `sum` with a heavy turn weight flips it: the unbounded hazard
            assert flipped.any()


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("form", ["bounded", "sum"])
def test_a_missing_answer_never_scores_better_than_a_wrong_one(form, source):
    # Completion 0 (the best turns of its group) gave no final answer although its checker said 1.
    adv, _, spans = credit(SOURCES[source], form, answered=torch.tensor([False, True, True, True]))
    mean_credit = adv.sum(dim=1) / (turn_token_index(spans, adv.shape[1]) >= 0).sum(dim=1)
    if form == "bounded":  # its outcome is the wrong one's, and its turn term adds nothing
        assert mean_credit[0] <= mean_credit[1:3].max() + 1e-5
        assert mean_credit[0] < 0
    else:  # `sum`: its good turns pay it more than the wrong answers get
        assert mean_credit[0] > mean_credit[1:3].max()


@pytest.mark.parametrize("form", ["bounded", "sum"])
def test_max_turns_is_scored_as_the_argument_says(form):
    stopped = torch.tensor([False, False, False, True])
    as_wrong, _, _ = credit(SOURCES["dense_prm"], form, stopped_at_max_turns=stopped)
    as_is, _, _ = credit(SOURCES["dense_prm"], form, stopped_at_max_turns=stopped, max_turns_outcome="as_is")
    plain, _, _ = credit(SOURCES["dense_prm"], form)
    scored_wrong, _, _ = credit(SOURCES["dense_prm"][:3] + [(0.0, SOURCES["dense_prm"][3][1])], form)
    assert torch.allclose(as_is, plain)
    assert torch.allclose(as_wrong, scored_wrong)
    assert not torch.allclose(as_wrong, plain)
    if form == "bounded":  # the outcome's sign holds: a stopped rollout scored wrong is not paid
        assert as_wrong[3, :4].max() < 0 < as_is[3, :4].min()
    else:  # `sum`: scored wrong, its well-scored turn still pays it (documented)
        assert as_wrong[3, :4].min() > 0


def test_bounded_hand_computed():
    # G = 2, outcomes (1, 0): A^O = (0.7071, -0.7071) (std of {1, 0} is 0.7071). Turn rewards pooled {1, 0, 0}:
    # mean 1/3, std 0.5774, z = (1.1547, -0.5774 | -0.5774); w = 1, b = 0.25: u = (0.25, -0.25 | -0.25).
    # Row 0 has turns of 2 and 2 tokens: centre 0, m = (0.25, -0.25); row 1 one turn: m = 0.
    outcomes = torch.tensor([1.0, 0.0])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    spans = torch.tensor([[[0, 2], [3, 5]], [[0, 3], [-1, -1]]])
    adv = turn_advantages(outcomes, rewards, spans, 6, 2)
    a = 0.70710678 / (1 + 1e-6 / 0.70710678)
    want = torch.tensor([[1.25 * a, 1.25 * a, 0, 0.75 * a, 0.75 * a, 0], [-a, -a, -a, 0, 0, 0]])
    assert torch.allclose(adv, want, atol=1e-5)
    # The all-equal group gets 0 everywhere, whatever its turns.
    tied = turn_advantages(torch.tensor([1.0, 1.0]), rewards, spans, 6, 2)
    assert (tied == 0).all()


def test_sum_hand_computed():
    # Same group under `sum` (w = 1): n = z = (1.1547, -0.5774 | -0.5774), suffix sums on policy tokens.
    outcomes = torch.tensor([1.0, 0.0])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    spans = torch.tensor([[[0, 2], [3, 5]], [[0, 3], [-1, -1]]])
    adv = turn_advantages(outcomes, rewards, spans, 6, 2, form="sum")
    a, z1, z0 = 0.7071063, 1.1547, -0.57735
    want = torch.tensor([[a + z1 + z0, a + z1 + z0, 0, a + z0, a + z0, 0], [-a + z0, -a + z0, -a + z0, 0, 0, 0]])
    assert torch.allclose(adv, want, atol=1e-4)


def test_bad_input_is_refused_with_the_field():
    rewards = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="turn_spans\\[0, 1\\]"):
        turn_advantages(torch.tensor([1.0, 0.0]), rewards, torch.tensor([[[0, 3], [2, 4]], [[0, 1], [-1, -1]]]), 6, 2)
    with pytest.raises(ValueError, match="bound"):
        turn_advantages(torch.tensor([1.0, 0.0]), rewards, torch.tensor([[[0, 3], [4, 5]], [[0, 1], [-1, -1]]]), 6, 2,
                        bound=0.5)
    with pytest.raises(ValueError, match="form must be one of"):
        turn_advantages(torch.tensor([1.0, 0.0]), rewards, torch.tensor([[[0, 3], [4, 5]], [[0, 1], [-1, -1]]]), 6, 2,
                        form="per_turn_index")


def test_turn_tensors_from_turn_records():
    turns = [[TurnRecord(0, 3, "tool_call", tool_end=5), TurnRecord(5, 7, "answer")],
             [TurnRecord(0, 2, "tool_call", tool_end=4), TurnRecord(4, 6, "max_turns")],
             [TurnRecord(0, 4, "void")]]
    spans, answered, stopped = turn_tensors(turns)
    assert spans.tolist() == [[[0, 3], [5, 7]], [[0, 2], [4, 6]], [[0, 4], [-1, -1]]]
    assert answered.tolist() == [True, False, False] and stopped.tolist() == [False, True, False]
    assert turn_token_index(spans, 8).tolist()[0] == [0, 0, 0, -1, -1, 1, 1, -1]  # tool tokens 3, 4: no turn
