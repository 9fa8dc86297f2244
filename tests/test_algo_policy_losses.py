"""The policy-loss forms (``algorithm.policy_loss``) against values and gradients computed by hand in float64
Python (1e-6, fp32 tensors), through the loss function the engine calls (``grpo_loss_fn``): GSPO, GSPO-token, GMPO,
CISPO; and what ties them to PPO: the same gradient at ratio 1, and micro-batch splits that sum to the whole."""

import math

import pytest
import torch

from grpo_mega.algo import compute_policy_loss, policy_loss
from grpo_mega.engine.base import LossScale
from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

MASK = [[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]  # row 0: a prompt token; row 1: padding
LOGP = [[-9.0, -1.2, -0.5, -2.0], [-0.3, -1.1, -7.0, -7.0], [-0.9, -1.4, -0.2, -3.1]]
ADV = [1.5, -0.7, 0.4]
# logp - old_logp. Small (GSPO's range): sequence means 0.02 (clipped above, A > 0), 0.001 (inside), -0.03 (below
# the range with A > 0: the unclipped term is the smaller objective, so it keeps its gradient); 9 on padding.
SMALL = [[0.0, 0.02, -0.01, 0.05], [0.004, -0.002, 9.0, 9.0], [-0.05, -0.03, -0.02, -0.02]]
# Large (GMPO's / CISPO's range): tokens beyond +-0.4 on both sides, for A > 0 and A < 0.
LARGE = [[0.0, 0.6, -0.1, 0.2], [-0.5, 0.3, 9.0, 9.0], [0.5, -0.6, 0.1, 0.0]]


def _tensors(deltas, advantages=None):
    logp = torch.tensor(LOGP, requires_grad=True)
    old = torch.tensor(LOGP) - torch.tensor(deltas)
    adv = advantages if advantages is not None else [[a] * 4 for a in ADV]
    mask = torch.tensor(MASK, dtype=torch.float32)
    return logp, {"loss_mask": mask, "advantages": torch.tensor(adv) * mask, "old_logprobs": old}


def _run(form, deltas, agg, advantages=None, **clip):
    """(loss, d loss / d logp, metrics) of ``form`` through grpo_loss_fn over the whole batch."""
    logp, micro = _tensors(deltas, advantages)
    mask = micro["loss_mask"]
    scale = LossScale(global_tokens=float(mask.sum()), global_seqs=3.0)
    settings = GRPOLossSettings(policy_loss=form, loss_agg_mode=agg, **clip)
    loss, metrics = grpo_loss_fn(settings)({"logprobs": logp, "entropy": torch.zeros(3, 4)}, micro, scale)
    loss.backward()
    return loss.item(), logp.grad, metrics


def _rows():
    for i, row in enumerate(MASK):
        yield i, [t for t, m in enumerate(row) if m]


def _assert_close(loss, grad, expected_loss, expected_grad):
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float32), atol=1e-6, rtol=0)


def _clip(x, low, high):
    return min(max(x, low), high)


def test_gspo_by_hand():
    low, high = 0.01, 0.015
    loss, grad, metrics = _run("gspo", SMALL, "seq-mean-token-mean", clip_low=low, clip_high=high)
    expected, expected_grad, clipped_tokens = 0.0, [[0.0] * 4 for _ in MASK], 0
    for i, tokens in _rows():
        s = math.exp(sum(SMALL[i][t] for t in tokens) / len(tokens))
        a = ADV[i]
        unclipped, clipped = -a * s, -a * _clip(s, 1 - low, 1 + high)
        expected += max(unclipped, clipped) / 3
        if clipped > unclipped:
            clipped_tokens += len(tokens)
        else:
            for t in tokens:  # d/dlogp_it of -A s_i / S, s_i = exp(mean_t d_it)
                expected_grad[i][t] = -a * s / len(tokens) / 3
    _assert_close(loss, grad, expected, expected_grad)
    assert clipped_tokens == 3  # row 0 alone
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(clipped_tokens / 9, abs=1e-7)
    assert "actor/pg_clipfrac_lower" not in metrics  # ppo's dual clip only
    assert grad[1].abs().sum() > 0 and grad[2].abs().sum() > 0


def test_gspo_paper_clip_range_clips_a_sequence_ratio_of_1_0005():
    deltas = [[0.0, 0.0005, 0.0005, 0.0005], [0.0001, 0.0001, 0, 0], [-0.0002, 0, -0.0002, 0]]
    loss, grad, metrics = _run("gspo", deltas, "seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4)
    assert grad[0].abs().sum() == 0  # 1.0005 > 1 + 4e-4 with A > 0: clipped
    assert grad[1].abs().sum() > 0 and grad[2].abs().sum() > 0  # 1.0001 and 0.9999 inside
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(3 / 9)


def test_gspo_token_by_hand_with_per_token_advantages():
    low, high = 0.01, 0.015
    advantages = [[0.0, 1.0, 1.0, -0.5], [-0.7, 0.2, 0.0, 0.0], [0.4, 0.4, -1.0, 2.0]]
    loss, grad, metrics = _run("gspo_token", SMALL, "seq-mean-token-mean", advantages, clip_low=low, clip_high=high)
    expected, expected_grad, clipped_tokens = 0.0, [[0.0] * 4 for _ in MASK], 0
    for i, tokens in _rows():
        s = math.exp(sum(SMALL[i][t] for t in tokens) / len(tokens))
        for t in tokens:
            a = advantages[i][t]
            unclipped, clipped = -a * s, -a * _clip(s, 1 - low, 1 + high)
            expected += max(unclipped, clipped) / len(tokens) / 3
            if clipped > unclipped:
                clipped_tokens += 1
            else:  # s_it = sg[s_i] pi_it / sg[pi_it]: d s_it / d logp_it = s_i
                expected_grad[i][t] = -a * s / len(tokens) / 3
    _assert_close(loss, grad, expected, expected_grad)
    # row 0 (s above the range): its two A = 1 tokens, not its A = -0.5 one; row 2 (s below): its A = -1 token
    assert clipped_tokens == 3 and grad[0, 3] != 0 and grad[2, 2] == 0
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(clipped_tokens / 9, abs=1e-7)


@pytest.mark.parametrize("deltas", [SMALL, LARGE], ids=["small", "large"])
def test_gspo_token_equals_gspo_with_one_advantage_per_sequence(deltas):
    gspo = _run("gspo", deltas, "seq-mean-token-mean", clip_low=0.01, clip_high=0.015)
    token = _run("gspo_token", deltas, "seq-mean-token-mean", clip_low=0.01, clip_high=0.015)
    assert token[0] == pytest.approx(gspo[0], abs=1e-7)
    torch.testing.assert_close(token[1], gspo[1], atol=1e-7, rtol=0)


def test_gmpo_by_hand():
    low, high = 0.4, 0.4
    loss, grad, metrics = _run("gmpo", LARGE, "seq-mean-token-mean", clip_low=low, clip_high=high)
    expected, expected_grad, clipped_tokens = 0.0, [[0.0] * 4 for _ in MASK], 0
    for i, tokens in _rows():
        a = ADV[i]
        kept = []
        for t in tokens:
            d = LARGE[i][t]
            c = _clip(d, -low, high)
            pessimistic = min(d, c) if a >= 0 else max(d, c)  # the smaller objective r * A
            kept.append(pessimistic == d)
            clipped_tokens += pessimistic != d
        logs = [min(LARGE[i][t], _clip(LARGE[i][t], -low, high)) if a >= 0
                else max(LARGE[i][t], _clip(LARGE[i][t], -low, high)) for t in tokens]
        ratio = math.exp(sum(logs) / len(tokens))
        expected += -a * ratio / 3
        for t, keep in zip(tokens, kept):
            expected_grad[i][t] = -a * ratio / len(tokens) / 3 if keep else 0.0
    _assert_close(loss, grad, expected, expected_grad)
    # row 0 (A > 0): 0.6 -> 0.4; row 1 (A < 0): -0.5 -> -0.4; row 2 (A > 0): 0.5 -> 0.4, -0.6 kept
    assert clipped_tokens == 3
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(3 / 9, abs=1e-7)


@pytest.mark.parametrize("low", [None, 0.3])
def test_cispo_by_hand_every_token_keeps_its_gradient(low):
    high = 0.2
    advantages = [[0.0, 1.0, 1.0, -0.5], [-0.7, 0.2, 0.0, 0.0], [0.4, 0.4, -1.0, 2.0]]
    loss, grad, metrics = _run("cispo", LARGE, "token-mean", advantages, clip_low=low, clip_high=high)
    expected, expected_grad, clipped_tokens = 0.0, [[0.0] * 4 for _ in MASK], 0
    for i, tokens in _rows():
        for t in tokens:
            r = math.exp(LARGE[i][t])
            w = min(r, 1 + high) if low is None else _clip(r, 1 - low, 1 + high)
            clipped_tokens += w != r
            a = advantages[i][t]
            expected += -w * a * LOGP[i][t] / 9
            expected_grad[i][t] = -w * a / 9  # through log pi only: the weight is detached
    _assert_close(loss, grad, expected, expected_grad)
    # above 1.2: e^0.6, e^0.2, e^0.3, e^0.5; below 0.7 (low 0.3): e^-0.5, e^-0.6
    assert clipped_tokens == (4 if low is None else 6)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(clipped_tokens / 9, abs=1e-7)
    assert (grad[torch.tensor(MASK, dtype=torch.bool) & (torch.tensor(advantages) != 0)] != 0).all()


def test_ppo_form_is_the_policy_loss_of_before():
    logp, micro = _tensors(LARGE)
    args = (logp, micro["old_logprobs"], micro["advantages"], micro["loss_mask"])
    for dual_clip in (None, 3.0):
        old_loss, old_metrics = policy_loss(*args, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
        loss, metrics = compute_policy_loss("ppo", *args, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
        assert torch.equal(loss, old_loss)
        assert metrics.keys() == old_metrics.keys()
        assert all(torch.equal(metrics[k], old_metrics[k]) for k in metrics)
    assert GRPOLossSettings().policy_loss == "ppo"


@pytest.mark.parametrize("form,agg", [("gspo", "seq-mean-token-mean"), ("gspo_token", "seq-mean-token-mean"),
                                      ("gmpo", "seq-mean-token-mean"), ("cispo", "token-mean"),
                                      ("cispo", "seq-mean-token-sum")])
def test_at_ratio_one_every_form_has_ppos_gradient(form, agg):
    """On-policy (one update per rollout batch) every ratio is 1 and nothing is clipped: each form's gradient is
    PPO's under the same aggregation, -A / n_i / S (or -A / N)."""
    zeros = [[0.0] * 4 for _ in MASK]
    grad_ppo = _run("ppo", zeros, agg)[1]
    grad = _run(form, zeros, agg)[1]
    torch.testing.assert_close(grad, grad_ppo, atol=1e-7, rtol=0)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("form,agg,clip", [
    ("gspo", "seq-mean-token-mean", dict(clip_low=0.01, clip_high=0.015)),
    ("gspo_token", "seq-mean-token-mean", dict(clip_low=0.01, clip_high=0.015)),
    ("gmpo", "seq-mean-token-mean", dict(clip_low=0.4, clip_high=0.4)),
    ("cispo", "token-mean", dict(clip_low=None, clip_high=0.2)),
])
def test_micro_batch_losses_and_gradients_sum_to_the_whole_batch(form, agg, clip):
    deltas = SMALL if form.startswith("gspo") else LARGE
    logp, micro = _tensors(deltas)
    mask = micro["loss_mask"]
    scale = LossScale(global_tokens=float(mask.sum()), global_seqs=3.0)
    loss_fn = grpo_loss_fn(GRPOLossSettings(policy_loss=form, loss_agg_mode=agg, kl_coef=0.1, **clip))
    micro["ref_logprobs"] = micro["old_logprobs"] + 0.1
    entropy = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    whole, whole_metrics = loss_fn({"logprobs": logp, "entropy": entropy}, micro, scale)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    total, grads, clipfrac = 0.0, [], 0.0
    for rows in (slice(0, 1), slice(1, 3)):
        part_logp = logp.detach()[rows].clone().requires_grad_()
        part, part_metrics = loss_fn({"logprobs": part_logp, "entropy": entropy[rows]},
                                     {k: v[rows] for k, v in micro.items()}, scale)
        total = total + part.detach()
        clipfrac += part_metrics["actor/pg_clipfrac"].item()
        grads.append(torch.autograd.grad(part, part_logp)[0])
    torch.testing.assert_close(total, whole.detach(), atol=1e-7, rtol=0)
    torch.testing.assert_close(torch.cat(grads), whole_grad, atol=1e-7, rtol=0)
    assert clipfrac == pytest.approx(whole_metrics["actor/pg_clipfrac"].item(), abs=1e-7)
    assert whole_metrics["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("form", ["gspo", "gmpo"])
def test_per_sequence_forms_refuse_per_token_advantages_naming_the_row(form):
    advantages = [[0.0, 1.0, 1.0, 1.0], [-0.7, -0.7, 0.0, 0.0], [0.4, 0.4, -1.0, 0.4]]
    with pytest.raises(ValueError, match=rf"policy_loss={form} needs one advantage per sequence, but row 2's "
                                         r"tokens carry advantages from -1 to 0.4.*use gspo_token"):
        _run(form, SMALL, "seq-mean-token-mean", advantages)


def test_settings_refuse_token_mean_for_sequence_forms_and_dual_clip_outside_ppo():
    for form in ("gspo", "gspo_token", "gmpo"):
        with pytest.raises(ValueError, match=rf"policy_loss={form} is a sequence-level loss"):
            GRPOLossSettings(policy_loss=form, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="policy_loss='vanilla'"):
        GRPOLossSettings(policy_loss="vanilla")
    logp, micro = _tensors(LARGE)
    with pytest.raises(ValueError, match="dual_clip applies to policy_loss=ppo only, not cispo"):
        compute_policy_loss("cispo", logp, micro["old_logprobs"], micro["advantages"], micro["loss_mask"],
                            clip_low=None, clip_high=0.2, dual_clip=3.0)
