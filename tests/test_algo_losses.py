"""Policy loss, KL estimators, loss aggregation and shaping."""

import math

import pytest
import torch

from grpo_mega.algo import (
    aggregate_loss,
    clip_advantages,
    clip_rewards,
    kl_estimate,
    policy_loss,
    whiten,
)


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    d = math.log(0.5)  # ref - logp
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - d - 1)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_k3_is_nonnegative_and_zero_at_equality():
    logp = torch.randn(100)
    ref = torch.randn(100)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros(100))


def test_kl_log_ratio_is_clamped_before_the_estimator():
    # d = ref - logp: 100 (policy far below the reference), -100, and ordinary values.
    ref = torch.tensor([0.0, -100.0, -1.0, -2.0, -0.3])
    logp = torch.tensor([-100.0, 0.0, -1.5, -0.7, -0.3], requires_grad=True)
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    assert k3[0].item() == pytest.approx(math.exp(20) - 20 - 1, rel=1e-6)
    assert k3[1].item() == pytest.approx(math.exp(-20) + 20 - 1, rel=1e-6)
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # Beyond the bound the estimate is constant: no gradient; within it, the k3 gradient 1 - pi_ref / pi.
    assert logp.grad[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(logp.grad[2:], 1 - torch.exp(ref[2:] - logp.detach()[2:]))
    for kind in ("k1", "k2", "k3"):
        small = kl_estimate(logp[2:], ref[2:], kind)
        assert torch.equal(small, kl_estimate(logp[2:], ref[2:], kind, log_ratio_clamp=None))
    assert kl_estimate(logp[:1], ref[:1], "k1").item() == -20.0
    assert kl_estimate(logp[:1], ref[:1], "k2", log_ratio_clamp=5.0).item() == 12.5
    # Without the clamp, exp(100) overflows fp32: the step's loss would be inf.
    assert torch.isinf(kl_estimate(logp[:1], ref[:1], "k3", log_ratio_clamp=None)).all()
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_estimate(logp, ref, "k3", log_ratio_clamp=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.04, 0.5])
def test_grpo_gradient_matches_deepseekmath_coefficient(beta):
    """At rho = 1 the gradient of -(A rho) + beta k3 w.r.t. logp is -(A + beta (pi_ref / pi - 1))."""
    torch.manual_seed(0)
    rows, length = 6, 9
    logp = (-torch.rand(rows, length) * 3).requires_grad_()
    ref = -torch.rand(rows, length) * 3
    adv = torch.randn(rows)
    mask = (torch.rand(rows, length) > 0.2).float()
    per_token, _ = policy_loss(logp, logp.detach(), adv, mask)
    loss = aggregate_loss(per_token + beta * kl_estimate(logp, ref, "k3"), mask, "token-mean")
    loss.backward()
    coefficient = adv.unsqueeze(1) + beta * (torch.exp(ref - logp.detach()) - 1)
    expected = -coefficient * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)


def test_clipping_and_clip_higher():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 0.9, 1.1, 1.5]]))
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    # A > 0: the objective min(rho, clip(rho)) stops rewarding rho beyond 1 + clip_high.
    torch.testing.assert_close(loss, -torch.tensor([[0.5, 0.9, 1.1, 1.28]]))
    assert metrics["clipfrac"].item() == pytest.approx(0.25)
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    # A < 0: below 1 - clip_low the ratio is clipped; above it is not.
    torch.testing.assert_close(loss, torch.tensor([[0.8, 0.9, 1.1, 1.5]]))


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 2.0, 10.0]]))
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(logp, old, torch.tensor([-2.0]), mask, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0, 6.0]]))
    assert metrics["dual_clipfrac"].item() == pytest.approx(1 / 3)
    # positive advantages are untouched by dual clip
    loss, _ = policy_loss(logp, old, torch.tensor([2.0]), mask, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.4, -2.4]]))
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, torch.tensor([2.0]), mask, dual_clip=0.5)


def test_approx_kl_metric_is_masked_mean_of_old_minus_new():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, metrics = policy_loss(logp, old, torch.tensor([1.0]), mask)
    assert metrics["approx_kl"].item() == pytest.approx(-0.25)


LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10.0 / 4),
        ("seq-mean-token-mean", (2.0 + 4.0) / 2),
        ("seq-mean-token-sum", (6.0 + 4.0) / 2),
        ("seq-mean-token-sum-norm", (6.0 + 4.0) / (2 * 8)),
    ],
)
def test_aggregation_modes_by_hand(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode, norm_length=8).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_micro_batches_with_global_counts_sum_to_full_batch_loss(mode):
    torch.manual_seed(1)
    loss = torch.randn(10, 7)
    mask = (torch.rand(10, 7) > 0.3).float()
    mask[:, 0] = 1
    full = aggregate_loss(loss, mask, mode, norm_length=7)
    counts = {"global_tokens": mask.sum(), "global_seqs": (mask.sum(1) > 0).sum()}
    for micro in (1, 3, 4):
        parts = [
            aggregate_loss(loss[i : i + micro], mask[i : i + micro], mode, norm_length=7, **counts)
            for i in range(0, 10, micro)
        ]
        torch.testing.assert_close(torch.stack(parts).sum(), full)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm")


def test_shaping():
    torch.testing.assert_close(clip_rewards(torch.tensor([-5.0, 0.5, 5.0]), 2.0), torch.tensor([-2.0, 0.5, 2.0]))
    torch.testing.assert_close(clip_advantages(torch.tensor([-5.0, 0.5]), 1.0), torch.tensor([-1.0, 0.5]))
    with pytest.raises(ValueError):
        clip_rewards(torch.ones(2), 0.0)
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    out = whiten(values, mask, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(whiten(values, mask, shift_mean=False, eps=0.0), torch.tensor([1.0, 2.0, 3.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2"):
        whiten(values, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_overlong_penalty_is_linear_in_the_buffer():
    from grpo_mega.algo import overlong_penalty

    lengths = torch.tensor([10, 12, 14, 16])
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4, 1.0), torch.tensor([0.0, 0.0, -0.5, -1.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 16, 16, 1.0)
