"""parallel.distributed_optimizer: megatron's DistributedOptimizer on gloo, exact, half the optimizer bytes at DP=2,
and checkpoints that resume across DP / TP and across having it or not.

One 2-process job at DP=2 trains the same 4 GRPO steps twice from the same seed, without and with the distributed
optimizer, saving each run after step 2 (it goes on to step 4: the uninterrupted run). Fresh processes (the saving
ones are gone, as after a kill) then resume from step 2: from the distributed run's checkpoint at DP=1 (one
process) and at TP=2 (both with the plain optimizer, DP being 1) and at DP=2 with it; from the plain run's at DP=2
with it. Every continuation must follow the uninterrupted run.
"""

from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

SEED = 11
TOTAL_STEPS = 4
SAVED_STEP = 2
CONFIG = {"parallel": {"tensor": 1, "pipeline": 1}, "trainer": {"total_steps": TOTAL_STEPS}}
# (name, TP, distributed_optimizer setting, which run's checkpoint) of the two-process resumes
TWO_RANK_RESUMES = [
    ("tp2_from_distributed", 2, True, True),  # TP=2 leaves DP=1: the plain optimizer takes the sharded state
    ("dp2_distributed_from_plain", 1, True, False),
    ("dp2_distributed_from_distributed", 1, True, True),
]  # distributed -> plain at DP=2 is the same mapping as at TP=2 and at DP=1 (below), minus the layout change


def _engine(distributed_optimizer):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    # adam_eps 1e-4: with 1e-8, Adam's first steps turn reduction-order noise in near-zero gradient entries (1e-9)
    # into 1e-4 of update (see test_engine_megatron); the comparisons are about the gradients and moments.
    optim = OptimConfig(lr=2e-2, weight_decay=0.1, clip_grad=1.0, warmup_steps=1, decay_style="cosine",
                        adam_eps=1e-4)
    return build_policy_engine(tiny_qwen2_config(tied=True, num_layers=2), optim=optim, total_steps=TOTAL_STEPS,
                               max_tokens_per_micro_batch=40, distributed_optimizer=distributed_optimizer)


def _train_step(engine, step):
    from test_training_checkpoint import _grpo_update, _rng_draws

    metrics = _grpo_update(engine, step)
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "lr": metrics["lr"], "rng": _rng_draws()}


def _params(engine):
    return {name: p.detach().clone() for name, p in engine.stage.named_parameters()}


def _optimizer_kind(engine):
    return type(engine.optimizer.chained_optimizers[0]).__name__


def _dp2_runs(run_dirs):
    """DP=2: the plain run, then the distributed-optimizer run, each from the same seed, saving after step 2."""
    from test_training_checkpoint import _probe_logprobs

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import init_distributed, seed_everything

    init_distributed(1, 1, seed=SEED, device="cpu")
    runs = {}
    for distributed in (False, True):
        seed_everything(SEED)
        engine = _engine(distributed)
        run = {"kind": _optimizer_kind(engine), "steps": [], "params": [_params(engine)]}
        for step in range(1, TOTAL_STEPS + 1):
            run["steps"].append(_train_step(engine, step))
            run["params"].append(_params(engine))
            if step == 1:
                run["bytes"] = engine.static_memory_bytes()
            if step == SAVED_STEP:
                CheckpointManager(run_dirs[distributed]).save(engine, step, extra_state={"step": step}, config=CONFIG)
        run["probe_at_end"] = _probe_logprobs(engine)
        runs[distributed] = run
    return runs


def _resume_and_finish(distributed, run_dir):
    from test_training_checkpoint import _probe_logprobs

    from grpo_mega.checkpoint.training import CheckpointManager

    engine = _engine(distributed)
    manager = CheckpointManager(run_dir)
    loaded = manager.load(engine, manager.find_resume("auto"), seed=SEED + 500)
    result = {"kind": _optimizer_kind(engine), "step": loaded.step, "steps": []}
    for step in range(loaded.step + 1, TOTAL_STEPS + 1):
        result["steps"].append(_train_step(engine, step))
    result["probe_at_end"] = _probe_logprobs(engine)
    result["params"] = _params(engine)
    return result


def _two_rank_resumes(run_dirs):
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    # Another seed than the saving run: whatever the resumed run needs must come from the checkpoint.
    init_distributed(1, 1, seed=SEED + 500, device="cpu")
    results = {}
    for name, tp, distributed, from_distributed in TWO_RANK_RESUMES:
        destroy_model_parallel()
        init_model_parallel(tp, 1, seed=SEED + 500)
        results[name] = _resume_and_finish(distributed, run_dirs[from_distributed])
    return results


def _one_rank_resume(run_dir):
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED + 500, device="cpu")
    return _resume_and_finish(True, run_dir)  # the setting asks for it; at DP=1 there is nothing to shard


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distopt")
    run_dirs = {False: str(root / "plain"), True: str(root / "distributed")}
    dp2 = run_distributed(_dp2_runs, 2, run_dirs)
    resumed = {name: [rank[name] for rank in run_distributed(_two_rank_resumes, 2, run_dirs)]
               for name, *_ in TWO_RANK_RESUMES}
    resumed["dp1_from_distributed"] = run_distributed(_one_rank_resume, 1, run_dirs[True])
    return dp2, resumed, run_dirs


def test_step_with_distributed_optimizer_equals_step_without(runs):
    dp2, *_ = runs
    for rank in dp2:
        plain, sharded = rank[False], rank[True]
        assert plain["kind"] != "DistributedOptimizer" and sharded["kind"] == "DistributedOptimizer"
        for step, (a, b) in enumerate(zip(plain["steps"], sharded["steps"], strict=True), start=1):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), step
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-5, rel=1e-5), step
        for step in range(TOTAL_STEPS + 1):
            for name, value in plain["params"][step].items():
                torch.testing.assert_close(sharded["params"][step][name], value, atol=1e-5, rtol=0,
                                           msg=f"step {step}: {name}")
        # step 1 is the warm-up's (lr 0); the later steps really change the weights
        moved = max((plain["params"][2][k] - plain["params"][1][k]).abs().max().item() for k in plain["params"][0])
        assert moved > 1e-3


def test_distributed_optimizer_halves_optimizer_state_per_rank_at_dp2(runs):
    dp2, *_ = runs
    for rank in dp2:
        plain, sharded = rank[False]["bytes"], rank[True]["bytes"]
        # fp32 model: the parameters are their own master copy; Adam's two moments are the optimizer state.
        parameters = sum(value.numel() * value.element_size() for value in rank[False]["params"][0].values())
        assert plain["parameters"] == parameters and plain["optimizer_state"] >= 2 * parameters
        assert sharded["optimizer_state"] == pytest.approx(plain["optimizer_state"] / 2, rel=0.01)
        # the distributed optimizer's contiguous buffers pad to a multiple of the DP size; nothing else changes
        assert sharded["parameters"] == pytest.approx(parameters, rel=0.01)
        assert sharded["gradients"] == pytest.approx(plain["gradients"], rel=0.01)


@pytest.mark.parametrize("name", [name for name, *_ in TWO_RANK_RESUMES] + ["dp1_from_distributed"])
def test_resume_continues_like_the_uninterrupted_run(runs, name):
    dp2, resumed, _ = runs
    straight = dp2[0][True]  # equal to the plain run (test above)
    same_layout = name.startswith("dp2")
    expected_kind = "DistributedOptimizer" if name.startswith("dp2_distributed") else "FP32Optimizer"
    for result in resumed[name]:
        assert result["step"] == SAVED_STEP and result["kind"] == expected_kind
        for step, (got, want) in enumerate(zip(result["steps"], straight["steps"][SAVED_STEP:], strict=True)):
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), step
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-5, rel=1e-5), step
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
            if same_layout:  # RNG states restored rank for rank
                assert got["rng"] == want["rng"]
        torch.testing.assert_close(result["probe_at_end"], straight["probe_at_end"], atol=1e-5, rtol=0)
    if name != "tp2_from_distributed":  # TP=2 shards are compared through the probe above
        for name_, value in straight["params"][TOTAL_STEPS].items():
            torch.testing.assert_close(resumed[name][0]["params"][name_], value, atol=1e-5, rtol=0, msg=name_)


def test_optimizer_state_that_cannot_be_mapped_is_a_start_up_error_naming_the_setting(runs):
    """A tensor the other optimizer needs and the checkpoint lacks: a ValueError naming the setting and the way
    out, never a fresh optimizer. (Here the master copy of a parameter the checkpoint does not have.)"""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from grpo_mega.checkpoint.optimizer_state import _request_across_modes
    from grpo_mega.run.layout import STEP_DIR

    *_, run_dirs = runs
    for saved_distributed, wanted in ((False, "optimizer.state.param."), (True, "optimizer.state.fp32_param.")):
        checkpoints = Path(run_dirs[saved_distributed]) / "checkpoints"
        path = next(p for p in checkpoints.iterdir() if STEP_DIR.match(p.name))
        known = ShardedTensor.from_rank_offsets(wanted + "embedding.word_embeddings.weight", torch.zeros(2))
        assert _request_across_modes({"a": known}, path, saved_distributed=saved_distributed) == {0: known}
        assert known.key == ("embedding.word_embeddings.weight" if not saved_distributed  # fp32: the weights
                             else "optimizer.state.param.embedding.word_embeddings.weight")
        unknown = ShardedTensor.from_rank_offsets(wanted + "decoder.no_such.weight", torch.zeros(2))
        with pytest.raises(ValueError) as error:
            _request_across_modes({"a": unknown}, path, saved_distributed=saved_distributed)
        message = str(error.value)
        assert f"parallel.distributed_optimizer={str(saved_distributed).lower()}" in message
        assert f"resume with parallel.distributed_optimizer: {str(saved_distributed).lower()}" in message
        assert "model.init_from" in message
