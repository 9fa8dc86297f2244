"""The implicit PRM's math (PRIME) against hand-computed cases and torch autograd."""

import math

import pytest
import torch

from grpo_mega.algo.implicit_reward import (
    groups_within_accuracy,
    implicit_outcome_loss,
    implicit_step_scores,
    implicit_token_rewards,
    outcome_prediction_accuracy,
    step_sums,
)


def test_token_rewards_are_beta_times_the_log_ratio_on_response_tokens():
    prm = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    rewards = implicit_token_rewards(prm, ref, mask, beta=0.05)
    assert torch.allclose(rewards, torch.tensor([[0.0, -0.05, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="beta must be > 0"):
        implicit_token_rewards(prm, ref, mask, beta=0.0)
    with pytest.raises(ValueError, match="must have one shape"):
        implicit_token_rewards(prm, ref[:, :3], mask, beta=0.05)


def test_the_loss_is_the_cross_entropy_of_the_sigmoid_of_the_summed_rewards():
    rewards = torch.tensor([[0.2, 0.3, 0.0], [-0.4, 0.1, 0.0]])
    labels = torch.tensor([1.0, 0.0])
    s1, s2 = 0.5, -0.3
    expected = (-math.log(1 / (1 + math.exp(-s1))) - math.log(1 - 1 / (1 + math.exp(-s2)))) / 2
    assert implicit_outcome_loss(rewards, labels).item() == pytest.approx(expected, rel=1e-6)
    # a micro-batch's share of a global mean over 8 completions
    assert implicit_outcome_loss(rewards, labels, num_completions=8).item() == pytest.approx(expected * 2 / 8)
    assert outcome_prediction_accuracy(rewards, labels) == 1.0
    assert outcome_prediction_accuracy(-rewards, labels) == 0.0


def test_the_gradient_raises_the_log_ratio_of_correct_completions_and_lowers_wrong_ones():
    prm = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.2, -1.1]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.2, -1.1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    beta = 0.1
    loss = implicit_outcome_loss(implicit_token_rewards(prm, ref, mask, beta), torch.tensor([1.0, 0.0]))
    loss.backward()
    # at phi = ref every sum is 0, sigmoid 0.5: dL/dlogp_t = beta * (0.5 - y) / B on response tokens
    expected = torch.tensor([[-0.025, -0.025, 0.0], [0.025, 0.025, 0.025]])
    assert torch.allclose(prm.grad, expected)


def test_step_rewards_are_the_sums_of_each_steps_tokens():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]])
    ends = torch.tensor([[1, 4, -1], [3, -1, -1]])
    steps = step_sums(rewards, ends)
    assert torch.equal(steps, torch.tensor([[3.0, 12.0, 0.0], [2.0, 0.0, 0.0]]))
    # the steps add up to the completion's total implicit reward up to the last step's end
    assert steps[0].sum() == rewards[0, :5].sum()


def test_step_scores_are_the_sums_or_the_sigmoid_of_the_implicit_q_value_at_each_step_end():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0.5, -0.5, 0.5, -1.5, 0.0, 0.0]])
    ends = torch.tensor([[1, 4, -1], [3, -1, -1]])
    assert torch.equal(implicit_step_scores(rewards, ends, "sum"), step_sums(rewards, ends))
    probability = implicit_step_scores(rewards, ends, "probability")
    sigmoid = lambda q: 1 / (1 + math.exp(-q))  # noqa: E731
    expected = torch.tensor([[sigmoid(3.0), sigmoid(15.0), 0.0], [sigmoid(-1.0), 0.0, 0.0]])
    torch.testing.assert_close(probability, expected, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="sum.*probability"):
        implicit_step_scores(rewards, ends, "mean")


def test_the_accuracy_filter_keeps_groups_between_the_bounds():
    labels = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float)
    keep = groups_within_accuracy(labels, 4, 0.2, 0.8)  # accuracies 1.0, 0.25, 0.0
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        groups_within_accuracy(labels, 5, 0.2, 0.8)
