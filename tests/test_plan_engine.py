"""`grpo-mega plan` against what the Megatron engine really allocates, on CPU (gloo, 2 processes, megatron's own
DDP and optimizer): for the quickstart policy and a ~25M policy at TP2, PP2 and DP2, the planned parameter, gradient
and optimizer-state bytes of each rank equal the engine's tensors counted after a step, and the planned activation
peak (activations + log-prob buffers) is within 25 % of the peak measured over one forward-backward schedule
(``grpo_mega.plan.measure.LiveBytes``: every storage an aten op creates, alive or freed, forward and backward).

The batch holds two full-length groups (data.prompt_length + algorithm.response_length rows, G rows sharing each
prompt), so at DP2 each rank gets one, and at TP2 / PP2 each micro-batch holds one (PP2: both in flight on the first
stage, as the planner assumes)."""

import json

import pytest
import torch

from dist_utils import run_distributed

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
# the distributed optimizer's layout: sharded at DP2; at PP2 the quickstart's tied embedding copy gets its own bucket
DISTRIBUTED_OPTIMIZER_LAYOUTS = ("dp2", "pp2")
SIZE_25M = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4)  # bench/workload.py's 25m shape


def _cfg(model_dir, train_file, tp, pp, *extra):
    from grpo_mega.config import GRPOConfig, load_config, validate

    return load_config(GRPOConfig, "configs/quickstart_grpo.yaml", [
        f"model.hf_config={model_dir}", f"data.train_file={train_file}", "parallel.device=cpu",
        f"parallel.tensor={tp}", f"parallel.pipeline={pp}", *extra], validate)


def _full_groups_batch(cfg, groups=2, vocab=64):
    generator = torch.Generator().manual_seed(0)
    prompt, response = cfg.data.prompt_length, cfg.algorithm.response_length
    G = cfg.algorithm.num_return_sequences_in_group
    prompts = torch.randint(3, vocab, (groups, prompt), generator=generator).repeat_interleave(G, 0)
    responses = torch.randint(3, vocab, (groups * G, response), generator=generator)
    input_ids = torch.cat([prompts, responses], 1)
    rows, length = input_ids.shape
    loss_mask = torch.zeros(rows, length, dtype=torch.long)
    loss_mask[:, prompt:] = 1
    return dict(input_ids=input_ids, attention_mask=torch.ones(rows, length, dtype=torch.long), loss_mask=loss_mask,
                advantages=torch.randn(rows, 1, generator=generator).expand(rows, length).contiguous(),
                old_logprobs=-torch.rand(rows, length, generator=generator) - 1,
                prompt_lengths=torch.full((rows,), prompt))


def _measure_job(cases):
    """For each (name, model_dir, train_file, extra overrides): at each layout, this rank's counted static bytes
    after one GRPO step and the measured peak of its schedule."""
    from transformers import AutoConfig

    from grpo_mega.engine import build_policy_engine
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from grpo_mega.plan.measure import distributed_optimizer_bytes, engine_static_bytes, measure_schedule_peak

    init_distributed(1, 1, seed=3, device="cpu")
    results = {}
    for name, model_dir, train_file, extra in cases:
        for layout, (tp, pp) in LAYOUTS.items():
            destroy_model_parallel()
            init_model_parallel(tp, pp, seed=3)
            cfg = _cfg(model_dir, train_file, tp, pp, *extra)
            engine = build_policy_engine(
                AutoConfig.from_pretrained(model_dir), optim=cfg.optim, total_steps=2,
                max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                logprob_chunk_size=cfg.model.logprob_chunk_size, share_prompt_prefix=cfg.parallel.share_prompt_prefix)
            peaks = measure_schedule_peak(engine)
            engine.train_step(_full_groups_batch(cfg), grpo_loss_fn(GRPOLossSettings()))
            results[f"{name}/{layout}"] = {**engine_static_bytes(engine), "peak": peaks[0]}
            if layout in DISTRIBUTED_OPTIMIZER_LAYOUTS:
                results[f"{name}/{layout}/distopt"] = distributed_optimizer_bytes(engine)
    return results


@pytest.fixture(scope="module")
def measured_and_cases(tmp_path_factory):
    from tiny_task import build_tiny_task

    root = tmp_path_factory.mktemp("plan_engine")
    quick_dir, train_file = build_tiny_task(root / "quick")
    big_dir = root / "m25"
    big_dir.mkdir()
    config = json.loads((quick_dir / "config.json").read_text())
    config.update(SIZE_25M, tie_word_embeddings=False, max_position_embeddings=256)
    config.pop("layer_types", None)
    (big_dir / "config.json").write_text(json.dumps(config))
    cases = [
        ("quickstart", str(quick_dir), str(train_file), ()),
        # the row path (no shared prompts) and another shape: prompt 32, response 96, G 4, 512-token budget
        ("25m", str(big_dir), str(train_file), (
            "parallel.share_prompt_prefix=false", "data.prompt_length=32", "algorithm.response_length=96",
            "algorithm.num_return_sequences_in_group=4", "parallel.max_tokens_per_micro_batch=512")),
    ]
    by_rank = run_distributed(_measure_job, 2, cases, timeout=900)
    return by_rank, {name: (model_dir, train_file, extra) for name, model_dir, train_file, extra in cases}


def _plan(case, tp, pp, **assume):
    from grpo_mega.plan import plan_config

    model_dir, train_file, extra = case
    return plan_config(_cfg(model_dir, train_file, tp, pp, *extra), gpus_per_node=2, gpu_memory_gib=16,
                       assume=assume)


@pytest.mark.parametrize("model", ["quickstart", "25m"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planned_static_bytes_equal_the_engine_tensors(measured_and_cases, model, layout):
    by_rank, cases = measured_and_cases
    tp, pp = LAYOUTS[layout]
    plan = _plan(cases[model], tp, pp)
    for rank, measured in enumerate(by_rank):
        stage = plan.stages[rank // tp if pp > 1 else 0]
        counted = measured[f"{model}/{layout}"]
        assert (stage.params, stage.grads, stage.optimizer) == (
            counted["params"], counted["grads"], counted["optimizer"]), f"rank {rank}"


@pytest.mark.parametrize("model", ["quickstart", "25m"])
@pytest.mark.parametrize("layout", DISTRIBUTED_OPTIMIZER_LAYOUTS)
def test_planned_distributed_optimizer_bytes_equal_megatrons_partition(measured_and_cases, model, layout):
    """With the distributed optimizer (assumed on, as the engine turns it on at DP > 1): parameters and
    gradients in megatron's padded buffers, master copies and moments for this rank's share of each bucket, as
    megatron's DDP and DistributedOptimizer partition them."""
    by_rank, cases = measured_and_cases
    tp, pp = LAYOUTS[layout]
    plan = _plan(cases[model], tp, pp, distributed_optimizer="true")
    without = _plan(cases[model], tp, pp, distributed_optimizer="false")
    for rank, measured in enumerate(by_rank):
        stage = plan.stages[rank // tp if pp > 1 else 0]
        counted = measured[f"{model}/{layout}/distopt"]
        assert (stage.params, stage.grads, stage.optimizer) == (
            counted["params"], counted["grads"], counted["optimizer"]), f"rank {rank}"
    if layout == "dp2":  # the optimizer state halves at DP2
        assert plan.policy.optimizer == pytest.approx(without.policy.optimizer / 2, rel=0.01)


@pytest.mark.parametrize("model", ["quickstart", "25m"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planned_activation_peak_within_25_percent(measured_and_cases, model, layout):
    by_rank, cases = measured_and_cases
    tp, pp = LAYOUTS[layout]
    plan = _plan(cases[model], tp, pp)
    measured = max(r[f"{model}/{layout}"]["peak"] for r in by_rank)
    planned = plan.activations + plan.logprob_buffers
    print(f"{model}/{layout}: planned {planned} measured {measured} ({planned / measured - 1:+.1%})")
    assert abs(planned / measured - 1) <= 0.25
