"""Sampler/trainer mismatch: log-prob difference metrics and truncated importance weights."""

import math

import pytest
import torch

from grpo_mega.algo import rollout_logprob_diff, truncated_importance_weights


def test_truncated_importance_weights_by_hand_and_capped():
    old = torch.log(torch.tensor([[0.1, 0.5, 0.9, 0.6], [0.3, 0.2, 0.8, 1.0]]))
    rollout = torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.5], [0.9, 0.01, 0.4, 1e-30]]))
    weights = truncated_importance_weights(old, rollout, cap=2.0)
    expected = torch.tensor([[0.5, 1.0, 2.0, 1.2], [1 / 3, 2.0, 2.0, 2.0]])
    torch.testing.assert_close(weights, expected)
    # A sampler log-prob of -inf (a token it could not have sampled in its own numerics) gets the cap, not inf.
    assert truncated_importance_weights(old[:1, :1], torch.tensor([[-math.inf]]), cap=3.0).item() == 3.0
    generator = torch.Generator().manual_seed(0)
    wild = truncated_importance_weights(
        10 * torch.randn(1000, generator=generator), 10 * torch.randn(1000, generator=generator), cap=1.5
    )
    assert wild.max().item() == 1.5 and wild.min().item() > 0
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(old, rollout, cap=0.0)


def test_truncated_importance_weights_carry_no_gradient():
    old = torch.log(torch.tensor([0.4, 0.5, 0.05])).requires_grad_()
    rollout = torch.log(torch.tensor([0.5, 0.4, 0.5])).requires_grad_()
    weights = truncated_importance_weights(old, rollout, cap=2.0)
    assert not weights.requires_grad and weights.grad_fn is None
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (weights * values * old).sum().backward()
    # d/d old of w * v * old with w a constant: w * v.
    torch.testing.assert_close(old.grad, weights * values.detach())
    assert rollout.grad is None


def test_rollout_logprob_diff_by_hand_over_masked_tokens():
    trainer = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.01, 0.6, 0.3]]))
    rollout = torch.log(torch.tensor([[0.4, 0.25, 0.1], [0.02, 0.5, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the largest difference (0.9 vs 0.1) is masked out
    metrics = rollout_logprob_diff(trainer, rollout, mask)
    log_diffs = [math.log(0.5 / 0.4), 0.0, math.log(2.0), math.log(0.6 / 0.5), 0.0]
    prob_diffs = [0.1, 0.0, 0.01, 0.1, 0.0]
    assert metrics["rollout/logprob_diff_mean"].item() == pytest.approx(sum(log_diffs) / 5, rel=1e-5)
    assert metrics["rollout/logprob_diff_max"].item() == pytest.approx(math.log(2.0), rel=1e-5)
    assert metrics["rollout/probs_diff_mean"].item() == pytest.approx(sum(prob_diffs) / 5, rel=1e-4)
    assert metrics["rollout/probs_diff_max"].item() == pytest.approx(0.1, rel=1e-4)
    assert all(value.dim() == 0 and not value.requires_grad for value in metrics.values())


def test_rollout_logprob_diff_of_no_tokens_is_zero_and_shapes_must_agree():
    trainer = torch.randn(2, 3)
    metrics = rollout_logprob_diff(trainer, trainer + 1, torch.zeros(2, 3))
    assert set(metrics) == {
        "rollout/logprob_diff_mean",
        "rollout/logprob_diff_max",
        "rollout/probs_diff_mean",
        "rollout/probs_diff_max",
    }
    assert all(value.item() == 0.0 for value in metrics.values())
    with pytest.raises(ValueError, match="one shape"):
        rollout_logprob_diff(trainer, trainer[:, :2], torch.ones(2, 3))
