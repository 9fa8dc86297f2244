"""torch's fused AdamW kernel in megatron-core's optimizer (grpo_mega.engine.fused_adam): the same training as the
foreach kernel megatron-core falls back to without Transformer Engine / apex, fresh and after a resume whose saved
param groups do not ask for it. The fused kernel runs on the CPU since torch 2.4, so the switch is tested here."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed, tiny_qwen2_config
from tests.test_engine_shared_prefix import _grouped_batch

STEPS = 3


def _engine(ref_dir, fused=True):
    """adam_eps 1e-4 as in tests/test_engine_megatron.py: an entry whose gradient is near 0 moves by up to lr on the
    last bit of its gradient, and the two kernels' weights differ in the last bit after one step."""
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    import grpo_mega.engine.megatron_engine as megatron_engine

    switch = megatron_engine.fused_adam_for_device
    if not fused:  # megatron-core's own choice: torch's foreach kernels
        megatron_engine.fused_adam_for_device = lambda optimizer, device: None
    try:
        engine = build_policy_engine(tiny_qwen2_config(tied=False),
                                     optim=OptimConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-4),
                                     total_steps=STEPS, max_tokens_per_micro_batch=64)
    finally:
        megatron_engine.fused_adam_for_device = switch
    engine.load_model_weights(ref_dir)
    return engine


def _step(engine, step):
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    metrics = engine.train_step(_grouped_batch(seed=step), grpo_loss_fn(GRPOLossSettings()))
    engine.lr_schedule_step()
    return metrics["loss"]


def _params(engine):
    return {name: p.detach().clone() for name, p in engine.stage.named_parameters()}


def _job(ref_dir):
    import torch.optim.adam as adam_module

    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.engine.fused_adam import torch_adam_optimizers
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=3, device="cpu")
    build_policy_engine(tiny_qwen2_config(tied=False), optim=OptimConfig(), total_steps=1,
                        max_tokens_per_micro_batch=64).save_model_weights(ref_dir)
    fused_calls = []
    original = adam_module._fused_adam

    def counting(*args, **kwargs):
        fused_calls.append(len(args[0]))
        return original(*args, **kwargs)

    adam_module._fused_adam = counting
    out = {}
    try:
        foreach = _engine(ref_dir, fused=False)
        out["foreach_losses"] = [_step(foreach, step) for step in range(1, STEPS)]
        saved = copy.deepcopy(foreach.optimizer.state_dict())  # after STEPS - 1 steps, groups without 'fused'
        saved_weights = _params(foreach)
        out["foreach_losses"].append(_step(foreach, STEPS))
        out["foreach"] = _params(foreach)
        out["foreach_fused_calls"] = len(fused_calls)

        fused = _engine(ref_dir)  # the engine switches to the fused kernel itself (the CPU has it)
        out["switched"] = [group["fused"] for o in torch_adam_optimizers(fused.optimizer) for group in o.param_groups]
        out["groups"] = sum(len(o.param_groups) for o in torch_adam_optimizers(fused.optimizer))
        out["fused_losses"] = [_step(fused, step) for step in range(1, STEPS + 1)]
        out["fused"] = _params(fused)
        out["fused_calls"] = len(fused_calls)

        resumed = _engine(ref_dir)
        with torch.no_grad():
            for name, param in resumed.stage.named_parameters():
                param.copy_(saved_weights[name])
        resumed.load_optimizer_state_dict(saved)
        (inner,) = torch_adam_optimizers(resumed.optimizer)
        out["loaded_fused_flag"] = inner.param_groups[0].get("fused")  # the engine keeps its built settings
        for _ in range(1, STEPS):
            resumed.lr_schedule_step()
        before = len(fused_calls)
        out["resumed_loss"] = _step(resumed, STEPS)
        out["resumed_fused_calls"] = len(fused_calls) - before
        out["resumed_steps"] = sorted({float(state["step"]) for state in inner.state.values()})
        out["resumed"] = _params(resumed)
    finally:
        adam_module._fused_adam = original
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_job, 1, str(tmp_path_factory.mktemp("fused_adam") / "ref"))[0]


def test_fused_adamw_trains_as_the_foreach_fallback(runs):
    assert set(runs["switched"]) == {True} and runs["foreach_fused_calls"] == 0
    # one fused kernel call per param group (weight decay on / off) and step: one device, one dtype
    assert runs["fused_calls"] == STEPS * runs["groups"]
    assert runs["fused_losses"] == pytest.approx(runs["foreach_losses"], rel=1e-5)
    for name, value in runs["foreach"].items():  # lr 1e-2: the weights moved by ~1e-2, rounding is ~1e-7
        torch.testing.assert_close(runs["fused"][name], value, atol=2e-6, rtol=1e-5, msg=name)


def test_a_resumed_optimizer_steps_fused_from_its_saved_state(runs):
    assert runs["loaded_fused_flag"] is True
    assert runs["resumed_fused_calls"] == runs["groups"]
    assert runs["resumed_steps"] == [float(STEPS)]  # the step counts continued from the checkpoint's
    assert runs["resumed_loss"] == pytest.approx(runs["foreach_losses"][-1], rel=1e-5)
    for name, value in runs["foreach"].items():
        torch.testing.assert_close(runs["resumed"][name], value, atol=2e-6, rtol=1e-5, msg=name)


def test_the_switch_is_made_where_the_kernel_runs_and_only_for_torch_adam():
    from grpo_mega.engine.fused_adam import fused_adam_for_device, torch_adam_optimizers, use_fused_adam

    param = torch.nn.Parameter(torch.ones(3))
    adamw = torch.optim.AdamW([param], lr=0.1)
    fused_adam_for_device(adamw, torch.device("meta"))
    assert adamw.param_groups[0]["fused"] is None  # no fused kernel there: megatron's choice stays
    fused_adam_for_device(adamw, torch.device("cpu"))
    assert adamw.param_groups[0]["fused"] is True and adamw.param_groups[0]["foreach"] is False
    assert torch_adam_optimizers(torch.optim.SGD([param], lr=0.1)) == []
    assert use_fused_adam(torch.optim.SGD([param], lr=0.1)) == 0
    integer = torch.nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)
    assert use_fused_adam(torch.optim.AdamW([integer], lr=0.1)) == 0  # no fused kernel for integer tensors


def test_a_resume_does_not_report_the_kernel_as_a_changed_setting():
    from grpo_mega.engine.lr_schedule import keep_optimizer_settings, optimizer_settings

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, fused=True)
    built = optimizer_settings(optimizer)
    optimizer.param_groups[0].update(fused=None, foreach=None, eps=1e-6)  # a checkpoint of the foreach kernel
    assert keep_optimizer_settings(optimizer, built) == ["eps 1e-06 -> 1e-08"]
    assert optimizer.param_groups[0]["fused"] is True


def test_a_state_dict_without_the_flag_or_with_host_steps_steps_fused():
    """What a plain ``load_state_dict`` brings back (an old checkpoint: groups without 'fused', a step as a number
    on the host) is put right by the step's pre-hook before the kernel reads it."""
    from grpo_mega.engine.fused_adam import use_fused_adam

    reference = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    reference.param_groups[0]["params"][0].grad = torch.full((4,), 0.5)
    reference.step()
    param = torch.nn.Parameter(reference.param_groups[0]["params"][0].detach().clone())
    saved = copy.deepcopy(reference.state_dict())
    saved["param_groups"][0].pop("fused")
    saved["state"][0]["step"] = 1.0  # a number, as very old torch checkpoints hold it
    adamw = torch.optim.AdamW([param], lr=0.1)
    assert use_fused_adam(adamw) == 1
    adamw.load_state_dict(saved)
    param.grad = torch.full((4,), 0.5)
    adamw.step()
    assert adamw.param_groups[0]["fused"] is True
    step = adamw.state[param]["step"]
    assert torch.is_tensor(step) and step.device == param.device and float(step) == 2.0
    reference.step()
    torch.testing.assert_close(param.detach(), reference.param_groups[0]["params"][0].detach())
