"""The GRPO loss function the engine calls per micro-batch: truncated importance sampling against the sampler's
log-probs (``rollout_is``), the KL log-ratio clamp, and global-batch shares of its metrics."""

import math

import pytest
import torch

from grpo_mega.engine.base import LossScale
from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

ROWS, LENGTH = 3, 6
CAP = 2.0


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(ROWS, LENGTH)
    mask[0, :2] = 0  # prompt tokens
    mask[2, 4:] = 0  # padding
    old = -3 * torch.rand(ROWS, LENGTH, generator=generator)
    logp = old + 0.3 * torch.randn(ROWS, LENGTH, generator=generator)  # some ratios beyond the clip range
    micro = {
        "loss_mask": mask,
        "advantages": torch.randn(ROWS, 1, generator=generator).expand(ROWS, LENGTH) * mask,
        "old_logprobs": old,
        "ref_logprobs": old + 0.5 * torch.randn(ROWS, LENGTH, generator=generator),
        # A mismatch of up to +-2 nats between trainer and sampler: weights from e^-2 to the cap.
        "rollout_logprobs": old + 4 * torch.rand(ROWS, LENGTH, generator=generator) - 2,
    }
    outputs = {"logprobs": logp.requires_grad_(), "entropy": torch.rand(ROWS, LENGTH, generator=generator)}
    return outputs, micro


# The whole batch is one of several micro-batches: shares are of these global counts.
SCALE = LossScale(global_tokens=40.0, global_seqs=5.0)


def _by_hand_pg(logp, old, adv, clip=0.2):
    ratio = torch.exp(logp - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))


def test_rollout_is_none_is_the_unweighted_loss_whatever_the_sampler_logprobs():
    outputs, micro = _batch()
    settings = GRPOLossSettings(kl_coef=0.1, entropy_coef=0.01, rollout_is="none")
    loss, metrics = grpo_loss_fn(settings)(outputs, micro, SCALE)
    logp, mask = outputs["logprobs"].detach(), micro["loss_mask"]
    d = micro["ref_logprobs"] - logp
    per_token = (
        _by_hand_pg(logp, micro["old_logprobs"], micro["advantages"])
        + 0.1 * (torch.exp(d) - d - 1)
        - 0.01 * outputs["entropy"]
    )
    expected = (per_token * mask).sum() / SCALE.global_tokens
    torch.testing.assert_close(loss.detach(), expected)
    assert not any(name.startswith("actor/tis") for name in metrics)
    micro["rollout_logprobs"] = micro["rollout_logprobs"] - 5.0
    assert torch.equal(grpo_loss_fn(settings)(outputs, micro, SCALE)[0], loss)


@pytest.mark.parametrize("on_policy", [False, True])
def test_tis_with_sampler_equal_to_old_logprobs_is_the_none_loss(on_policy):
    outputs, micro = _batch(1)
    common = dict(kl_coef=0.05, on_policy=on_policy, rollout_is_cap=CAP)
    old = outputs["logprobs"].detach() if on_policy else micro["old_logprobs"]
    micro["rollout_logprobs"] = old.clone()
    losses, grads = [], []
    for mode in ("none", "tis"):
        outputs["logprobs"].grad = None
        loss, metrics = grpo_loss_fn(GRPOLossSettings(rollout_is=mode, **common))(outputs, micro, SCALE)
        loss.backward()
        losses.append(loss.detach())
        grads.append(outputs["logprobs"].grad.clone())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-7)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-7)
    mask = micro["loss_mask"]
    assert metrics["actor/tis_weight_mean"].item() == pytest.approx(mask.sum().item() / SCALE.global_tokens)
    assert metrics["actor/tis_clipfrac"].item() == 0.0


def test_tis_weights_and_loss_by_hand_with_a_known_mismatch():
    outputs, micro = _batch(2)
    log_ratios = torch.log(torch.tensor([0.25, 0.5, 1.0, 1.5, 3.0, 40.0]))  # old - rollout per column
    micro["rollout_logprobs"] = micro["old_logprobs"] - log_ratios
    settings = GRPOLossSettings(rollout_is="tis", rollout_is_cap=CAP)
    loss, metrics = grpo_loss_fn(settings)(outputs, micro, SCALE)
    weights = torch.tensor([0.25, 0.5, 1.0, 1.5, CAP, CAP]).expand(ROWS, LENGTH)
    logp, mask = outputs["logprobs"].detach(), micro["loss_mask"]
    pg = _by_hand_pg(logp, micro["old_logprobs"], micro["advantages"])
    torch.testing.assert_close(loss.detach(), (weights * pg * mask).sum() / SCALE.global_tokens)
    torch.testing.assert_close(metrics["actor/tis_weight_mean"], (weights * mask).sum() / SCALE.global_tokens)
    capped_tokens = mask[:, 4:].sum()  # the 3.0 and 40.0 columns
    assert metrics["actor/tis_clipfrac"].item() == pytest.approx((capped_tokens / SCALE.global_tokens).item())
    # The policy-gradient metrics are those of the unweighted loss.
    unweighted = grpo_loss_fn(GRPOLossSettings())(outputs, micro, SCALE)[1]
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"):
        assert torch.equal(metrics[name], unweighted[name])


def test_no_gradient_flows_through_the_tis_weights():
    # On-policy the weights are min(exp(logp - rollout), cap) of the *current* log-probs: a gradient through them
    # would double the gradient of every uncapped token (d/dlogp of w * -A * rho is -2 A w at rho = 1).
    outputs, micro = _batch(3)
    logp = outputs["logprobs"]
    micro["rollout_logprobs"] = logp.detach() - torch.log(torch.tensor([0.5, 1.0, 1.9, 2.5, 7.0, 0.1]))
    settings = GRPOLossSettings(rollout_is="tis", rollout_is_cap=CAP, on_policy=True)
    loss, _ = grpo_loss_fn(settings)(outputs, micro, SCALE)
    loss.backward()
    weights = torch.tensor([0.5, 1.0, 1.9, CAP, CAP, 0.1])
    expected = -micro["advantages"] * weights * micro["loss_mask"] / SCALE.global_tokens
    torch.testing.assert_close(logp.grad, expected)


def test_tis_losses_and_metrics_of_micro_batches_sum_to_the_whole_batch():
    outputs, micro = _batch(4)
    mask = micro["loss_mask"]
    scale = LossScale(global_tokens=mask.sum().item(), global_seqs=float(ROWS))
    settings = GRPOLossSettings(rollout_is="tis", rollout_is_cap=1.5, kl_coef=0.1, loss_agg_mode="seq-mean-token-sum")
    loss_fn = grpo_loss_fn(settings)
    whole_loss, whole = loss_fn(outputs, micro, scale)
    parts = [
        loss_fn({k: v[rows] for k, v in outputs.items()}, {k: v[rows] for k, v in micro.items()}, scale)
        for rows in (slice(0, 1), slice(1, ROWS))
    ]
    torch.testing.assert_close(sum(p[0] for p in parts), whole_loss)
    for name in ("actor/tis_weight_mean", "actor/tis_clipfrac"):
        torch.testing.assert_close(sum(p[1][name] for p in parts), whole[name])
    assert 0 < whole["actor/tis_clipfrac"] < 1 and 0 < whole["actor/tis_weight_mean"] <= 1.5


def test_kl_term_uses_the_log_ratio_clamp():
    outputs, micro = _batch(5)
    micro["ref_logprobs"] = micro["ref_logprobs"].clone()
    micro["ref_logprobs"][1, 3] = outputs["logprobs"][1, 3].detach() + 100.0  # reference far above the policy
    settings = GRPOLossSettings(kl_coef=0.1)
    loss, metrics = grpo_loss_fn(settings)(outputs, micro, SCALE)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(outputs["logprobs"].grad).all()
    assert metrics["actor/kl_loss"].item() >= (math.exp(20) - 21) / SCALE.global_tokens * (1 - 1e-6)
    unclamped = GRPOLossSettings(kl_coef=0.1, kl_log_ratio_clamp=None)
    assert torch.isinf(grpo_loss_fn(unclamped)(outputs, micro, SCALE)[0])


def test_settings_reject_unknown_correction_and_bad_cap():
    with pytest.raises(ValueError, match="rollout_is='is'"):
        GRPOLossSettings(rollout_is="is")
    with pytest.raises(ValueError, match="rollout_is_cap"):
        GRPOLossSettings(rollout_is="tis", rollout_is_cap=0.0)
    outputs, micro = _batch()
    del micro["rollout_logprobs"]
    with pytest.raises(KeyError, match="rollout_logprobs"):
        grpo_loss_fn(GRPOLossSettings(rollout_is="tis"))(outputs, micro, SCALE)


def test_on_policy_loss_reports_the_sampler_trainer_logprob_gap_of_its_tokens():
    outputs, micro = _batch()
    _, metrics = grpo_loss_fn(GRPOLossSettings(on_policy=True))(outputs, micro, SCALE)
    mask = micro["loss_mask"].bool()
    gap = (outputs["logprobs"].detach() - micro["rollout_logprobs"]).abs()[mask]
    # the mean is a share of the global token count (summed over micro-batches); the max is this micro-batch's
    torch.testing.assert_close(metrics["rollout/logprob_diff_mean"], gap.sum() / SCALE.global_tokens)
    torch.testing.assert_close(metrics["rollout/logprob_diff_max"], gap.max())
    # off-policy the trainer's old log-probs come from a separate pass, which reports the gap instead
    _, off_policy = grpo_loss_fn(GRPOLossSettings())(outputs, micro, SCALE)
    assert "rollout/logprob_diff_mean" not in off_policy
