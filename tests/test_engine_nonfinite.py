"""A NaN / Inf loss or gradient norm stops the step before the optimizer applies anything: NonFiniteError on
every rank, parameters bit-identical, optimizer state untouched (the next good step equals a fresh engine's).
Both layouts (TP=2, DP=2) run in one job of 2 processes (module fixture ``by_tp``: a spawn costs ~10 s of imports
per process)."""

import math

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config


def _engine():
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    return build_policy_engine(tiny_qwen2_config(tied=False, num_layers=2), optim=optim, total_steps=4,
                               max_tokens_per_micro_batch=24)


def _batch():
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 301, (4, 10), generator=generator)
    attention_mask = (torch.arange(10) < torch.tensor([10, 7, 9, 6])[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :2] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def _nan_loss(outputs, micro, scale):
    from grpo_mega.sft import sft_loss

    loss, metrics = sft_loss(outputs, micro, scale)
    return loss * float("nan"), metrics


def _inf_gradient(outputs, micro, scale):
    """A finite loss whose gradient is infinite (as an overflow in a backward kernel would make it)."""
    from grpo_mega.sft import sft_loss

    outputs["logprobs"].register_hook(lambda grad: grad + float("inf"))
    return sft_loss(outputs, micro, scale)


def _params(engine):
    return {name: p.detach().clone() for name, p in engine.stage.named_parameters()}


def _nonfinite_steps(tp):
    """At TP=tp (DP = 2 / tp): two non-finite steps, then a good one; a twin with the same weights takes only
    the good one."""
    from grpo_mega.engine import NonFiniteError
    from grpo_mega.parallel import destroy_model_parallel, init_model_parallel
    from grpo_mega.sft import sft_loss

    destroy_model_parallel()
    init_model_parallel(tp, 1, seed=9)
    engine = _engine()
    twin = _engine()
    twin.load_model_state_dict(engine.stage.state_dict())
    before = _params(engine)
    result = {"errors": []}
    for loss_fn in (_nan_loss, _inf_gradient):
        try:
            engine.train_step(_batch(), loss_fn)
        except NonFiniteError as error:
            result["errors"].append((str(error), error.loss, error.grad_norm))
        else:
            result["errors"].append(None)
        after = _params(engine)
        result.setdefault("identical", []).append(all(torch.equal(after[n], before[n]) for n in before))
    result["steps_done"] = engine.steps_done
    # Adam moments and step counts appear at the first applied step.
    result["optimizer_state"] = len(engine.optimizer.state)
    good = engine.train_step(_batch(), sft_loss)
    twin_good = twin.train_step(_batch(), sft_loss)
    result["good_loss"], result["twin_loss"] = good["loss"], twin_good["loss"]
    result["good_grad_norm"], result["twin_grad_norm"] = good["grad_norm"], twin_good["grad_norm"]
    after_good, twin_after = _params(engine), _params(twin)
    result["good_equals_twin"] = all(torch.equal(after_good[n], twin_after[n]) for n in after_good)
    result["good_moved"] = max((after_good[n] - before[n]).abs().max().item() for n in before)
    result["steps_done_after_good"] = engine.steps_done
    return result


def _check(per_rank):
    for result in per_rank:
        (nan_message, nan_loss, _), (inf_message, inf_loss, inf_grad_norm) = result["errors"]
        assert math.isnan(nan_loss) and "loss nan" in nan_message and "not applied" in nan_message
        # The Inf came from the gradient alone: the loss is finite, the grad norm is not.
        assert math.isfinite(inf_loss) and not math.isfinite(inf_grad_norm)
        assert f"loss {inf_loss!r}" in inf_message and f"grad norm {inf_grad_norm!r}" in inf_message
        assert result["identical"] == [True, True]  # bit for bit, after each refused step
        assert result["steps_done"] == 0 and result["optimizer_state"] == 0
        # The refused steps left no trace (no Adam step, no stale gradient): the next step is a fresh one.
        assert result["good_loss"] == result["twin_loss"] and result["good_grad_norm"] == result["twin_grad_norm"]
        assert result["good_equals_twin"] and result["good_moved"] > 1e-4
        assert result["steps_done_after_good"] == 1


TENSOR_PARALLEL = (2, 1)  # TP=2; TP=1, DP=2


def _nonfinite_steps_at_each_tp():
    from grpo_mega.parallel import init_distributed

    init_distributed(TENSOR_PARALLEL[0], 1, seed=9, device="cpu")
    return {tp: _nonfinite_steps(tp) for tp in TENSOR_PARALLEL}


@pytest.fixture(scope="module")
def by_tp():
    """Every rank's results of ``_nonfinite_steps``, by TP."""
    per_rank = run_distributed(_nonfinite_steps_at_each_tp, 2)
    return {tp: [rank[tp] for rank in per_rank] for tp in TENSOR_PARALLEL}


def test_non_finite_step_raises_on_every_rank_and_changes_nothing_tp2(by_tp):
    _check(by_tp[2])


def test_non_finite_step_raises_on_every_rank_and_changes_nothing_dp2(by_tp):
    _check(by_tp[1])
