"""Resume with an Adam whose bias correction reads the param-group ``step``, as Transformer Engine's and apex's
FusedAdam do (issue 79, item 1): the counter comes from the checkpoint, never from the fresh optimizer.

megatron-core picks its Adam at import: TE's FusedAdam, else apex's, else torch's (``megatron.core.optimizer`` and
``...optimizer.distrib_optimizer``: ``Adam``, ``USING_PYTORCH_OPTIMIZER``, ``HAVE_APEX_OR_TE``,
``USING_TE_OPTIMIZER``). :func:`_as_if_transformer_engine` sets those names as a TE install would, with
:class:`GroupStepAdam` (TE FusedAdam's arithmetic and step counting, on the CPU) in place of TE's class, so
megatron's TE code paths (the group ``step`` saved and loaded by the DistributedOptimizer, no per-parameter step)
run as on a GPU cluster.

One 2-process job trains 3 steps at TP=2 (plain optimizer), then 3 steps at DP=2 with the distributed optimizer,
each saving after step 2. Fresh processes then resume step 3: TP=2 from the TP=2 checkpoint, DP=2 distributed from
the distributed one (both bit-equal to the uninterrupted runs) and TP=2 from the distributed checkpoint (the state
mapped across optimizers; another layout, so equal to reduction-order noise).
"""

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

SEED = 23
TOTAL_STEPS = 3
SAVED_STEP = 2
CONFIG = {"trainer": {"total_steps": TOTAL_STEPS}}
# (name, TP, distributed optimizer) of the two runs; each saves after SAVED_STEP
RUNS = [("tp2", 2, False), ("dp2_distributed", 1, True)]
# (name, TP, distributed optimizer, checkpoint of run) of the resumes
RESUMES = [("tp2", 2, False, "tp2"), ("dp2_distributed", 1, True, "dp2_distributed"),
           ("tp2_from_distributed", 2, False, "dp2_distributed")]


class GroupStepAdam(torch.optim.Optimizer):
    """Adam / AdamW counting its steps as TE's and apex's FusedAdam do: ``group["step"]`` (absent until the first
    step, then +1 per ``step()``) is the ``t`` of the bias corrections ``1 - beta1**t``, ``1 - beta2**t``; the
    per-parameter state holds only the moments. Takes megatron's arguments for them (``adam_w_mode``)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            t = group["step"]
            correction1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
            correction2 = 1 - beta2 ** t if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                grad = p.grad
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                else:
                    grad = grad + group["weight_decay"] * p
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / correction1)


def _as_if_transformer_engine():
    """Set megatron-core's optimizer choice as its imports do when Transformer Engine is installed."""
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    optimizer.Adam = GroupStepAdam
    optimizer.USING_PYTORCH_OPTIMIZER = False
    distrib_optimizer.Adam = GroupStepAdam
    distrib_optimizer.HAVE_APEX_OR_TE = True
    distrib_optimizer.USING_TE_OPTIMIZER = True
    distrib_optimizer.USING_APEX_OPTIMIZER = False


def _engine(distributed_optimizer):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    optim = OptimConfig(lr=2e-2, weight_decay=0.1, clip_grad=1.0, warmup_steps=0, decay_style="cosine",
                        adam_eps=1e-4)
    engine = build_policy_engine(tiny_qwen2_config(tied=True, num_layers=2), optim=optim, total_steps=TOTAL_STEPS,
                                 max_tokens_per_micro_batch=40, distributed_optimizer=distributed_optimizer)
    inner = engine.optimizer.chained_optimizers[0].optimizer
    assert isinstance(inner, GroupStepAdam) and engine.distributed_optimizer == distributed_optimizer
    return engine


def _group_steps(engine):
    return sorted({group.get("step") for group in engine.optimizer.param_groups if group["params"]})


def _train_step(engine, step):
    from test_training_checkpoint import _grpo_update

    metrics = _grpo_update(engine, step)
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "group_steps": _group_steps(engine)}


def _params(engine):
    return {name: p.detach().clone() for name, p in engine.stage.named_parameters()}


def _uninterrupted_runs(run_dirs):
    from test_training_checkpoint import _probe_logprobs

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel, seed_everything

    _as_if_transformer_engine()
    init_distributed(1, 1, seed=SEED, device="cpu")
    runs = {}
    for name, tp, distributed in RUNS:
        destroy_model_parallel()
        init_model_parallel(tp, 1, seed=SEED)
        seed_everything(SEED)
        engine = _engine(distributed)
        steps = []
        for step in range(1, TOTAL_STEPS + 1):
            steps.append(_train_step(engine, step))
            if step == SAVED_STEP:
                CheckpointManager(run_dirs[name]).save(engine, step, extra_state={"step": step}, config=CONFIG)
        runs[name] = {"steps": steps, "params": _params(engine), "probe": _probe_logprobs(engine)}
    return runs


def _resumes(run_dirs):
    import logging

    from test_training_checkpoint import _probe_logprobs

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    _as_if_transformer_engine()
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("grpo_mega.checkpoint.training").addHandler(handler)
    logging.getLogger("grpo_mega.checkpoint.training").setLevel(logging.INFO)
    init_distributed(1, 1, seed=SEED + 500, device="cpu")
    results = {}
    for name, tp, distributed, source in RESUMES:
        destroy_model_parallel()
        init_model_parallel(tp, 1, seed=SEED + 500)
        engine = _engine(distributed)
        del messages[:]
        manager = CheckpointManager(run_dirs[source])
        loaded = manager.load(engine, manager.find_resume("auto"), seed=SEED + 500)
        result = {"step": loaded.step, "group_steps_loaded": _group_steps(engine),
                  "optimizer_lines": [m for m in messages if m.startswith("optimizer settings")], "steps": []}
        for step in range(loaded.step + 1, TOTAL_STEPS + 1):
            result["steps"].append(_train_step(engine, step))
        result["params"], result["probe"] = _params(engine), _probe_logprobs(engine)
        results[name] = result
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("group_step")
    run_dirs = {name: str(root / name) for name, *_ in RUNS}
    straight = run_distributed(_uninterrupted_runs, 2, run_dirs)
    resumed = run_distributed(_resumes, 2, run_dirs)
    return straight, resumed


def test_uninterrupted_runs_count_their_steps_in_the_param_groups(runs):
    straight, _ = runs
    for rank in straight:
        for name, *_ in RUNS:
            assert [step["group_steps"] for step in rank[name]["steps"]] == [[1], [2], [3]], name


@pytest.mark.parametrize("name", ["tp2", "dp2_distributed"])
def test_resume_is_bit_equal_to_the_uninterrupted_run(runs, name):
    straight, resumed = runs
    for rank_straight, rank_resumed in zip(straight, resumed, strict=True):
        want, got = rank_straight[name], rank_resumed[name]
        assert got["step"] == SAVED_STEP
        assert got["group_steps_loaded"] == [SAVED_STEP]  # the checkpoint's counter, not the fresh optimizer's
        assert got["optimizer_lines"] == []  # the config did not change: no "optimizer settings follow" line
        assert got["steps"] == want["steps"][SAVED_STEP:]  # losses, grad norms and counters, exactly
        for key, value in want["params"].items():
            assert torch.equal(got["params"][key], value), key
        assert torch.equal(got["probe"], want["probe"])


def test_resume_across_optimizers_keeps_the_counter(runs):
    straight, resumed = runs
    for rank_straight, rank_resumed in zip(straight, resumed, strict=True):
        want, got = rank_straight["dp2_distributed"], rank_resumed["tp2_from_distributed"]
        assert got["group_steps_loaded"] == [SAVED_STEP] and got["optimizer_lines"] == []
        assert got["steps"][0]["group_steps"] == [TOTAL_STEPS]
        assert got["steps"][0]["loss"] == pytest.approx(want["steps"][-1]["loss"], abs=1e-5)
        assert got["steps"][0]["grad_norm"] == pytest.approx(want["steps"][-1]["grad_norm"], rel=1e-5, abs=1e-5)
        torch.testing.assert_close(got["probe"], want["probe"], atol=1e-5, rtol=0)
