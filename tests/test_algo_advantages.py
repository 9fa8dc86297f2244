"""Advantages: hand-worked examples, edge cases and properties of outcome / process supervision."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_mega.algo import normalize_step_rewards, outcome_advantages, process_advantages


def test_two_plus_three_example():
    # Three answers to "2 + 3" with rewards 1, 0, 2: mean 1, std 1.
    rewards = torch.tensor([1.0, 0.0, 2.0])
    torch.testing.assert_close(outcome_advantages(rewards, 3, scale_by_std=False), torch.tensor([0.0, -1.0, 1.0]))
    torch.testing.assert_close(
        outcome_advantages(rewards, 3, eps=0.0), torch.tensor([0.0, -1.0, 1.0])
    )
    torch.testing.assert_close(
        outcome_advantages(rewards, 3), torch.tensor([0.0, -1.0, 1.0]) / (1.0 + 1e-6)
    )


def test_groups_are_contiguous_rows():
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0, 0.0, 1.0, 1.0, 1.0])
    adv = outcome_advantages(rewards, 2)
    std_of_pair = torch.tensor([1.0, 0.0]).std()
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0, -0.5, 0.5, 0.0, 0.0]) / (std_of_pair + 1e-6)
    torch.testing.assert_close(adv, expected)


def test_equal_rewards_give_zero_not_nan():
    adv = outcome_advantages(torch.tensor([0.7, 0.7, 0.7, 0.7]), 4)
    assert torch.equal(adv, torch.zeros(4))


def test_group_size_one_needs_no_std_scaling():
    with pytest.raises(ValueError, match="group_size >= 2"):
        outcome_advantages(torch.tensor([1.0, 2.0]), 1)
    assert torch.equal(outcome_advantages(torch.tensor([1.0, 2.0]), 1, scale_by_std=False), torch.zeros(2))


def test_nan_reward_names_the_row():
    with pytest.raises(ValueError, match=r"rewards\[4\].*completion 1 of group 1"):
        outcome_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, float("nan"), 0.0]), 3)


def test_batch_not_a_multiple_of_group_size():
    with pytest.raises(ValueError, match="group_size=4"):
        outcome_advantages(torch.ones(6), 4)


def test_process_hand_worked_example():
    # One group of two completions. Completion 0: steps ending at tokens 1 and 3 with rewards 1, 0.
    # Completion 1: one step ending at token 2 with reward 1.  Pool {1, 0, 1}: mean 2/3, std sqrt(1/3).
    step_rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    step_ends = torch.tensor([[1, 3], [2, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    adv = process_advantages(step_rewards, step_ends, mask, 2, eps=0.0)
    std = torch.tensor([1.0, 0.0, 1.0]).std()
    hi, lo = (1 - 2 / 3) / std, (0 - 2 / 3) / std
    expected = torch.tensor([[hi + lo, hi + lo, lo, lo, 0.0], [hi, hi, hi, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_process_min_credit_hand_worked_example():
    # The same group with PURE's min-form credit: a token gets the worst normalised step still ahead of it.
    step_rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    step_ends = torch.tensor([[1, 3], [2, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    adv = process_advantages(step_rewards, step_ends, mask, 2, eps=0.0, credit="min")
    std = torch.tensor([1.0, 0.0, 1.0]).std()
    hi, lo = (1 - 2 / 3) / std, (0 - 2 / 3) / std
    # completion 0: tokens 0-1 see steps {hi, lo} -> lo; tokens 2-3 see {lo}; token 4 is after the last step
    expected = torch.tensor([[lo, lo, lo, lo, 0.0], [hi, hi, hi, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    with pytest.raises(ValueError, match="credit"):
        process_advantages(step_rewards, step_ends, mask, 2, credit="max")


def test_completion_without_steps_gets_zero():
    step_rewards = torch.tensor([[0.9, 0.2], [0.0, 0.0], [0.4, 0.0]])
    step_ends = torch.tensor([[0, 2], [-1, -1], [1, -1]])
    adv = process_advantages(step_rewards, step_ends, torch.ones(3, 4), 3)
    assert torch.equal(adv[1], torch.zeros(4))
    assert adv[0].abs().sum() > 0


def test_group_whose_step_rewards_are_all_equal_gets_zero_advantages():
    # Two groups of two: the first has every step scored 0.6 (no signal), the second does not.
    step_rewards = torch.tensor([[0.6, 0.6], [0.6, 0.0], [0.9, 0.1], [0.3, 0.0]])
    step_ends = torch.tensor([[1, 3], [2, -1], [1, 3], [2, -1]])
    adv = process_advantages(step_rewards, step_ends, torch.ones(4, 4), 2)
    assert torch.equal(adv[:2], torch.zeros(2, 4))
    assert adv[2:].abs().sum() > 0


def test_group_without_any_steps_is_zero_not_nan():
    adv = process_advantages(torch.zeros(2, 2), torch.full((2, 2), -1), torch.ones(2, 3), 2)
    assert torch.equal(adv, torch.zeros(2, 3))


@pytest.mark.parametrize(
    "ends, mask_len, match",
    [
        ([[1, 7]], 5, r"step_ends\[0, 1\] = 7 is beyond the response"),
        ([[1, 4]], 3, r"step_ends\[0, 1\] = 4 points at a token outside response_mask"),
        ([[2, 1]], 5, "not strictly increasing"),
        ([[-1, 2]], 5, "real step after a -1"),
        ([[-3, 2]], 5, r"step_ends\[0, 0\] = -3"),
    ],
)
def test_bad_step_ends_are_named(ends, mask_len, match):
    mask = torch.zeros(2, 6)
    mask[:, :mask_len] = 1
    step_ends = torch.tensor(ends + [[0, 1]])
    with pytest.raises(ValueError, match=match):
        process_advantages(torch.ones(2, 2), step_ends, mask[:, : max(mask_len, 6)], 2)


def test_nan_step_reward_names_the_row():
    with pytest.raises(ValueError, match=r"step_rewards\[1\]"):
        process_advantages(
            torch.tensor([[1.0], [float("nan")]]), torch.tensor([[0], [0]]), torch.ones(2, 2), 2
        )


def test_nan_in_padding_step_is_ignored():
    adv = process_advantages(
        torch.tensor([[1.0, float("nan")], [0.0, 0.0]]), torch.tensor([[0, -1], [0, -1]]), torch.ones(2, 2), 2
    )
    assert torch.isfinite(adv).all()


@st.composite
def reward_groups(draw):
    group_size = draw(st.integers(2, 6))
    num_groups = draw(st.integers(1, 4))
    values = draw(
        st.lists(
            st.floats(-10, 10, allow_nan=False, width=32),
            min_size=group_size * num_groups,
            max_size=group_size * num_groups,
        )
    )
    return torch.tensor(values, dtype=torch.float64), group_size


@settings(max_examples=60, deadline=None)
@given(reward_groups(), st.booleans())
def test_outcome_advantages_sum_to_zero_per_group(data, scale_by_std):
    rewards, group_size = data
    adv = outcome_advantages(rewards, group_size, scale_by_std=scale_by_std)
    sums = adv.reshape(-1, group_size).sum(dim=1)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-6)


@st.composite
def stepped_groups(draw):
    group_size = draw(st.integers(2, 4))
    rows = group_size * draw(st.integers(1, 3))
    max_steps, length = 4, 12
    ends = torch.full((rows, max_steps), -1, dtype=torch.long)
    rewards = torch.zeros(rows, max_steps, dtype=torch.float64)
    mask = torch.zeros(rows, length)
    for row in range(rows):
        response_len = draw(st.integers(1, length))
        mask[row, :response_len] = 1
        positions = sorted(draw(st.sets(st.integers(0, response_len - 1), max_size=max_steps)))
        ends[row, : len(positions)] = torch.tensor(positions, dtype=torch.long)
        for j in range(len(positions)):
            rewards[row, j] = draw(st.floats(0, 1, allow_nan=False))
    return rewards, ends, mask, group_size


@settings(max_examples=60, deadline=None)
@given(stepped_groups())
def test_process_advantages_are_suffix_sums(data):
    rewards, ends, mask, group_size = data
    adv = process_advantages(rewards, ends, mask, group_size)
    normalized = normalize_step_rewards(rewards, ends >= 0, group_size)
    for row in range(rewards.shape[0]):
        step_ends = [e for e in ends[row].tolist() if e >= 0]
        start = 0
        for j, end in enumerate(step_ends):
            segment = adv[row, start : end + 1]
            # constant within a step
            assert torch.allclose(segment, segment[0].expand_as(segment))
            # one step to the next drops by exactly this step's normalised reward
            following = adv[row, end + 1] if end + 1 < adv.shape[1] else torch.tensor(0.0, dtype=adv.dtype)
            assert torch.isclose(segment[0] - following, normalized[row, j], atol=1e-9)
            start = end + 1
        assert torch.all(adv[row, start:] == 0)


@settings(max_examples=40, deadline=None)
@given(reward_groups(), st.booleans(), st.integers(1, 5))
def test_one_step_at_last_token_equals_outcome(data, scale_by_std, length):
    rewards, group_size = data
    rows = rewards.shape[0]
    lengths = torch.randint(1, length + 1, (rows,))
    mask = (torch.arange(length) < lengths.unsqueeze(1)).float()
    ends = (lengths - 1).unsqueeze(1)
    process = process_advantages(rewards.unsqueeze(1), ends, mask, group_size, scale_by_std=scale_by_std)
    outcome = outcome_advantages(rewards, group_size, scale_by_std=scale_by_std)
    assert torch.allclose(process, outcome.unsqueeze(1) * mask, atol=1e-9)
