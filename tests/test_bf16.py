"""bf16 training through the same megatron code a GPU runs (CPU matmuls and gloo handle bf16), where every other
CPU test is fp32: the model's layout in bf16, a DP=2 step with vs without the distributed optimizer, a checkpoint
of the distributed run saved at DP=2 and resumed at DP=1, offload during rollout with the distributed optimizer,
and HF -> megatron -> HF conversion of bf16 weights.

Tolerances. bf16 keeps 8 significant bits: neighbouring values differ by 2^-8 to 2^-7 of their size. Both
optimizers keep fp32 master weights and fp32 gradients (``grad_reduce_in_fp32``) and round the master weights to
bf16 after each step; they differ only in the order of fp32 sums (the gradient norm over shards, the reduce-scatter
against the all-reduce), ~1e-7 relative, which flips the bf16 rounding of a weight only where its master value
lies within ~1e-7 of a rounding boundary: a few weights by one bf16 step. So weights must agree to one bf16 step
(rtol 2^-7) with almost all of them equal, and losses / log-probs, which those flips and the bf16 forward move by
~1e-3 relative, to 1e-2. A resume at another DP size also reorders the gradient sums over the batch (one process
sums what two summed apiece): the same bounds hold. A wrong optimizer state or a lost step moves the loss by > 5 %
(the learning rate is 2e-2) and the weights by many bf16 steps.
"""

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

SEED = 7
TOTAL_STEPS = 3
SAVED_STEP = 2
BF16_STEP = 2**-7
LOSS_RTOL = 1e-2
CONFIG = {"parallel": {"tensor": 1, "pipeline": 1}, "trainer": {"total_steps": TOTAL_STEPS}}


def _engine(distributed_optimizer):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    optim = OptimConfig(lr=2e-2, weight_decay=0.1, clip_grad=1.0, warmup_steps=0, decay_style="constant",
                        adam_eps=1e-4)
    return build_policy_engine(tiny_qwen2_config(tied=True, num_layers=2), optim=optim, total_steps=TOTAL_STEPS,
                               max_tokens_per_micro_batch=40, distributed_optimizer=distributed_optimizer,
                               dtype=torch.bfloat16)


def _step(engine, step):
    from test_distributed_optimizer import _train_step

    result = _train_step(engine, step)
    return {"loss": result["loss"], "grad_norm": result["grad_norm"]}


def _params(engine):
    return {name: p.detach().float().clone() for name, p in engine.stage.named_parameters()}


def _layout(engine):
    """What a bf16 run's model looks like: parameter dtypes, DDP gradient buffers (dtype pairs), optimizer."""
    return {"param_dtypes": sorted({str(p.dtype) for p in engine.stage.parameters()}),
            "grad_buffers": [(str(b.param_dtype), str(b.grad_dtype)) for b in engine.model.buffers],
            "optimizer": type(engine.optimizer.chained_optimizers[0]).__name__}


def _dp2_runs(run_dir):
    """DP=2, bf16: the plain optimizer, the distributed one (saving at SAVED_STEP), and the distributed one with
    its state offloaded to the host before every step (what parallel.offload_during_rollout does)."""
    from test_training_checkpoint import _probe_logprobs

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import init_distributed, seed_everything

    init_distributed(1, 1, seed=SEED, device="cpu")
    runs = {}
    for name, distributed, offload in (("plain", False, False), ("distributed", True, False),
                                       ("offloaded", True, True)):
        seed_everything(SEED)
        engine = _engine(distributed)
        run = {"layout": _layout(engine), "steps": [], "released": []}
        for step in range(1, TOTAL_STEPS + 1):
            if offload and step > 1:  # Adam's state exists from the first step on
                run["released"].append(engine.offload_to_host())
                run["held_while_offloaded"] = engine.held_bytes()
            run["steps"].append(_step(engine, step))
            if name == "distributed" and step == SAVED_STEP:
                CheckpointManager(run_dir).save(engine, step, extra_state={"step": step}, config=CONFIG)
        run["params"] = _params(engine)
        run["probe"] = _probe_logprobs(engine).float()
        if name == "distributed":
            run["save"] = _save_bytes(engine)
        runs[name] = run
    return runs


def _save_bytes(engine):
    """What the distributed optimizer's fully_reshardable save gathers (megatron's own routine, as the checkpoint
    save calls it) against the planner's rule for the same parameters (grpo_mega.plan.static)."""
    from grpo_mega.plan.counts import param_infos
    from grpo_mega.plan.static import checkpoint_save_bytes

    gathered = engine.optimizer.chained_optimizers[0].get_parameter_state_dp_zero(
        use_gloo_comm=False, return_on_all_ranks=True)
    host = sum(tensor.numel() * tensor.element_size() for per_buffer in gathered.values() if isinstance(per_buffer, dict)
               for per_dtype in per_buffer.values() for key, tensor in per_dtype.items()
               if isinstance(tensor, torch.Tensor) and key in ("param", "exp_avg", "exp_avg_sq"))
    infos = param_infos(engine.stage)
    planned = checkpoint_save_bytes(infos, data_parallel=2, distributed_optimizer=True)
    return {"gathered_host": host, "planned_host": planned.host, "planned_device": planned.device,
            "elements": sum(p.numel for p in infos)}


def _resume_at_dp1(run_dir):
    from test_training_checkpoint import _probe_logprobs

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED + 100, device="cpu")
    engine = _engine(True)
    manager = CheckpointManager(run_dir)
    loaded = manager.load(engine, manager.find_resume("auto"), seed=SEED + 100)
    steps = [_step(engine, step) for step in range(loaded.step + 1, TOTAL_STEPS + 1)]
    return {"step": loaded.step, "steps": steps, "params": _params(engine), "probe": _probe_logprobs(engine).float(),
            "layout": _layout(engine)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("bf16"))
    dp2 = run_distributed(_dp2_runs, 2, run_dir)
    (resumed,) = run_distributed(_resume_at_dp1, 1, run_dir)
    return dp2, resumed


def _assert_weights_agree(got: dict, want: dict, what: str, *, max_unequal: float) -> None:
    """Every weight within one bf16 step at its tensor's largest magnitude, and at most ``max_unequal`` of them
    not bit-equal."""
    unequal = total = 0
    for name, value in want.items():
        limit = BF16_STEP * value.abs().max().item()
        off = (got[name] - value).abs().max().item()
        assert off <= limit, f"{what}: {name} off by {off:.3g} > one bf16 step ({limit:.3g})"
        unequal += int((got[name] != value).sum())
        total += value.numel()
    assert unequal <= max_unequal * total, f"{what}: {unequal} of {total} weights differ"


def test_a_bf16_model_is_bf16_throughout_with_one_gradient_buffer(runs):
    dp2, resumed = runs
    for run in (dp2[0]["plain"], dp2[0]["distributed"], resumed):
        assert run["layout"]["param_dtypes"] == ["torch.bfloat16"]  # norm weights included
        assert run["layout"]["grad_buffers"] == [("torch.bfloat16", "torch.float32")]
    assert dp2[0]["plain"]["layout"]["optimizer"] == "Float16OptimizerWithFloat16Params"
    assert dp2[0]["distributed"]["layout"]["optimizer"] == "DistributedOptimizer"


def test_dp2_step_with_the_distributed_optimizer_agrees_with_the_plain_one(runs):
    dp2, _ = runs
    for rank in dp2:
        plain, sharded = rank["plain"], rank["distributed"]
        for step, (a, b) in enumerate(zip(plain["steps"], sharded["steps"], strict=True), start=1):
            assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), step
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=LOSS_RTOL), step
        _assert_weights_agree(sharded["params"], plain["params"], "distributed vs plain", max_unequal=0.01)
        torch.testing.assert_close(sharded["probe"], plain["probe"], rtol=0, atol=LOSS_RTOL * 10)
    # the ranks hold one model (DP): bit-equal weights on both
    assert all(torch.equal(dp2[0]["distributed"]["params"][k], dp2[1]["distributed"]["params"][k])
               for k in dp2[0]["distributed"]["params"])


def test_offload_with_the_distributed_optimizer_changes_nothing(runs):
    dp2, _ = runs
    for rank in dp2:
        offloaded, straight = rank["offloaded"], rank["distributed"]
        assert all(released > 0 for released in offloaded["released"])
        held = offloaded["held_while_offloaded"]
        assert held["grad_buffers"] == 0 and held["optimizer_state"] == 0 and held["host"] > 0
        assert offloaded["steps"] == straight["steps"]  # bit for bit: the state came back unchanged
        assert all(torch.equal(offloaded["params"][k], v) for k, v in straight["params"].items())


def test_the_planned_save_host_memory_is_what_megatron_gathers(runs):
    """Every rank holds its stage's whole fp32 master weights and moments in host memory during a save with the
    distributed optimizer: 12 bytes per parameter (plus the padding of megatron's buffer); the planner adds one
    bucket being concatenated on top."""
    dp2, _ = runs
    for rank in dp2:
        save = rank["distributed"]["save"]
        assert save["gathered_host"] == 12 * save["elements"]  # measured: exactly, without the padding
        # planned: 12 bytes per element of the padded buffer + its one bucket (overlap_grad_reduce off) in fp32
        assert 12 * save["elements"] < save["planned_host"] <= 16 * save["elements"] * 1.01
        assert save["planned_device"] > 0


def test_a_dp2_checkpoint_resumes_at_dp1_like_the_uninterrupted_run(runs):
    dp2, resumed = runs
    straight = dp2[0]["distributed"]
    assert resumed["step"] == SAVED_STEP and resumed["layout"]["optimizer"] == "Float16OptimizerWithFloat16Params"
    (got,) = resumed["steps"]
    (want,) = straight["steps"][SAVED_STEP:]
    # The step's forward runs on the loaded weights: equal to the saved ones bit for bit, so the loss agrees to the
    # order of its fp32 sum over rows; the gradient is summed from bf16 micro-batch products grouped otherwise.
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)
    # Adam turns those gradient differences into update differences where a gradient entry is near zero: a few
    # per cent of the weights move to a neighbouring bf16 value (measured: 2.9 %, none by more than one step). A
    # lost optimizer state (fresh Adam: every update lr x sign) moves most weights by ~5 steps.
    _assert_weights_agree(resumed["params"], straight["params"], "resumed at DP=1", max_unequal=0.05)
    torch.testing.assert_close(resumed["probe"], straight["probe"], rtol=0, atol=LOSS_RTOL * 10)


def test_bf16_hf_weights_round_trip_through_megatron(tmp_path):
    (result,) = run_distributed(_hf_round_trip, 1, str(tmp_path))
    assert result["dtypes"] == ["torch.bfloat16"] == result["exported_dtypes"]
    assert result["max_weight_diff"] == 0.0  # conversion moves and reshapes bf16 values; it never rounds them
    # megatron's bf16 forward against transformers' bf16 forward of the same weights: the same products in
    # another order and kernel, rounded to bf16 at each layer: ~1e-2 of logits of size ~1-10
    assert result["max_logit_diff"] < 0.25 and result["argmax_agreement"] > 0.9


def _hf_round_trip(out_dir):
    """HF bf16 weights -> megatron model -> megatron checkpoint -> a fresh megatron model -> HF names again."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from grpo_mega.checkpoint import (
        HFWeights, export_hf_weights, load_hf_weights, load_mcore_checkpoint, mcore_logits, save_mcore_checkpoint,
    )
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED, device="cpu")
    config = tiny_qwen2_config(tied=False, num_layers=2)
    torch.manual_seed(SEED)
    hf_model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    hf_dir, ckpt_dir = Path(out_dir) / "hf", Path(out_dir) / "mcore"
    hf_model.save_pretrained(hf_dir)

    def build():
        return build_gpt_model(gpt_config_from_hf(config, tp=1, pp=1, dtype=torch.bfloat16,
                                                  overrides={"perform_initialization": False}))

    first = build()
    load_hf_weights(first, HFWeights(str(hf_dir)), config)
    save_mcore_checkpoint(first, str(ckpt_dir), str(hf_dir))
    model = build()
    load_mcore_checkpoint(model, str(ckpt_dir))
    reference = HFWeights(str(hf_dir))
    exported = dict(export_hf_weights(model, config))
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    got = mcore_logits(model, ids).float()
    with torch.no_grad():
        expected = hf_model(ids).logits.float()
    return {"dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "max_weight_diff": max(float((exported[k].float() - reference[k].float()).abs().max()) for k in reference),
            "exported_dtypes": sorted({str(t.dtype) for t in exported.values()}),
            "max_logit_diff": float((got - expected).abs().max()),
            "argmax_agreement": float((got.argmax(-1) == expected.argmax(-1)).float().mean())}
