"""LoRA on the Megatron engine (``model.lora``, ``grpo_mega.lora``), on 2 gloo processes at three layouts (TP=1 with
DP=2, TP=2, PP=2) in one job: a zero-initialised B gives the base's outputs exactly; only the adapters require
gradients and sit in the optimizer; their count is r (in + out) per adapted linear; one GRPO step (with the KL
loss against the reference = the adapters off) moves the merged weights the same at every layout and leaves the
base bit for bit; the merged export is W + (alpha / r) B A and, loaded into a plain model, gives the LoRA policy's
log-probs; a checkpoint holds the adapters alone and resumes bit-equal, also at another TP / PP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config
from grpo_mega.config import ConfigError, GRPOConfig
from grpo_mega.config.lora import LoRAConfig

REPO = Path(__file__).resolve().parent.parent
VOCAB = 301
BUDGET = 30
RANK, ALPHA = 4, 8.0
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP) on 2 processes: the first is DP=2


def _hf_config():
    return tiny_qwen2_config(tied=False, num_layers=2)


def _grouped_batch(seed: int):
    """4 prompts of 2-8 tokens with 3 responses each, GRPO fields set (as tests/test_sequence_parallel.py)."""
    from grpo_mega.data.batch import sequences_to_batch

    generator = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        count = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(0, VOCAB, (count,), generator=generator).tolist()

    prompts, responses = [], []
    for _ in range(4):
        prompt = tokens(2, 9)
        for _ in range(3):
            prompts.append(prompt)
            responses.append(tokens(1, 12))
    batch = sequences_to_batch(prompts, responses, pad_id=0)
    rows, width = batch["input_ids"].shape
    batch["advantages"] = torch.randn(rows, 1, generator=generator).expand(rows, width) * batch["loss_mask"]
    batch["old_logprobs"] = -torch.rand(rows, width, generator=generator) * 4 * batch["loss_mask"]
    batch["rollout_logprobs"] = batch["old_logprobs"].clone()
    return batch


def _policy(hf_dir, dropout: float = 0.0):
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.lora import lora_attacher

    # adam_eps 1e-4: see tests/test_engine_megatron.py (reduction-order noise in near-zero gradient entries)
    policy = build_policy_engine(
        _hf_config(), optim=OptimConfig(lr=1e-2, adam_eps=1e-4), total_steps=3, max_tokens_per_micro_batch=BUDGET,
        attach_adapters=lora_attacher(LoRAConfig(rank=RANK, alpha=ALPHA, dropout=dropout), seed=7, base=hf_dir))
    load_initial_weights(policy, hf_dir)
    return policy


def _grpo_step(policy, reference, seed: int):
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    batch = _grouped_batch(seed)
    batch["ref_logprobs"], _ = reference.forward_logprobs(batch, loss_tokens_only=True)
    return policy.train_step(batch, grpo_loss_fn(GRPOLossSettings(kl_coef=0.1, clip_high=0.28)))


def _layout_run(hf_dir, work_dir, previous_checkpoint):
    from megatron.core import parallel_state as mpu

    from grpo_mega.checkpoint.hf_convert import export_hf_weights
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.engine import build_reference_engine
    from grpo_mega.lora import AdaptersOffReference

    result = {}
    policy = _policy(hf_dir)
    reference = AdaptersOffReference(policy)
    base_engine = build_reference_engine(_hf_config(), max_tokens_per_micro_batch=BUDGET)
    load_initial_weights(base_engine, hf_dir)
    batch = _grouped_batch(0)
    mask = batch["loss_mask"].bool()

    def logprobs(engine):
        return engine.forward_logprobs(batch)[0][mask]

    result["start_on"], result["start_off"] = logprobs(policy), logprobs(reference)
    result["base"] = logprobs(base_engine)
    result["trainable"] = policy.lora.trainable_parameters()
    result["requires_grad"] = sorted(name for name, p in policy.stage.named_parameters() if p.requires_grad)
    # the optimizer's parameters (with the distributed optimizer at DP=2 each rank holds a shard: summed over DP),
    # and those of DDP's gradient buffers
    held = torch.tensor([float(sum(p.numel() for group in policy.optimizer.param_groups for p in group["params"]))])
    torch.distributed.all_reduce(held, group=mpu.get_data_parallel_group())
    result["optimizer_params"] = int(held.item())
    result["grad_buffer_params"] = sum(p.numel() for buffer in policy.model.buffers for p in buffer.params)
    result["local_adapter_params"] = policy.lora.local_parameters()
    base_before = dict(export_hf_weights(policy.stage, _hf_config()))

    metrics = _grpo_step(policy, reference, seed=1)
    result["grad_norm"] = metrics["grad_norm"]
    from grpo_mega.perf.parameters import parameter_figures

    result["figures"] = parameter_figures(policy)  # what the trainer logs with its first update
    result["static"] = policy.static_memory_bytes()
    # grpo-mega plan's static bytes of this stage (grpo_mega.plan.static) against the engine's tensors
    from grpo_mega.plan.counts import param_infos
    from grpo_mega.plan.measure import engine_static_bytes
    from grpo_mega.plan.static import training_static_bytes

    planned = training_static_bytes(param_infos(policy.stage), mpu.get_data_parallel_world_size(),
                                    policy.distributed_optimizer)
    result["planned_static"] = {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer}
    result["engine_static"] = engine_static_bytes(policy)
    base_after = dict(export_hf_weights(policy.stage, _hf_config()))
    result["base_unchanged"] = all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    merged = dict(policy.export_hf_weights())
    result["delta"] = {name: merged[name] - base_after[name] for name in merged}
    result["after_on"], result["after_off"] = logprobs(policy), logprobs(reference)
    if mpu.get_tensor_model_parallel_world_size() == 1 and policy.stage.pre_process:
        adapter = policy.lora.modules["layer0_linear_proj"]  # TP=1: whole A and B
        result["proj"] = (base_after["model.layers.0.self_attn.o_proj.weight"], adapter.A.detach().clone(),
                          adapter.B.detach().clone(), merged["model.layers.0.self_attn.o_proj.weight"])
    base_engine.load_hf_weights(merged)  # what the rollout engine is given: the merged weights
    result["merged_engine"] = logprobs(base_engine)

    checkpoint = CheckpointManager(f"{work_dir}/run").save(policy, 1)
    from megatron.core.dist_checkpointing import load_tensors_metadata

    result["checkpoint_keys"] = sorted(load_tensors_metadata(str(checkpoint)))
    _grpo_step(policy, reference, seed=2)
    result["continued"] = dict(policy.export_hf_weights())
    resumed = _policy(hf_dir)
    CheckpointManager(f"{work_dir}/run").load(resumed, checkpoint, seed=0)
    _grpo_step(resumed, AdaptersOffReference(resumed), seed=2)
    result["resumed"] = dict(resumed.export_hf_weights())
    # the checkpoint as a whole model (model.init_from, grpo-mega eval): its base with the adapters merged in
    whole = build_reference_engine(_hf_config(), max_tokens_per_micro_batch=BUDGET)
    load_initial_weights(whole, str(checkpoint))
    result["checkpoint_as_whole_model"] = logprobs(whole)
    if mpu.get_tensor_model_parallel_world_size() == 2:  # dropout: A of a column-parallel linear stays one tensor
        dropped = _policy(hf_dir, dropout=0.3)
        before = dropped.lora.modules["layer0_linear_qkv"].A.detach().clone()
        _grpo_step(dropped, AdaptersOffReference(dropped), seed=1)
        a = dropped.lora.modules["layer0_linear_qkv"].A.detach()
        replicas = [torch.empty_like(a) for _ in range(2)]
        torch.distributed.all_gather(replicas, a, group=mpu.get_tensor_model_parallel_group())
        result["dropout_replicas_equal"] = torch.equal(replicas[0], replicas[1])
        result["dropout_moved_a"] = not torch.equal(a, before)
    if previous_checkpoint is not None:  # the previous layout's checkpoint, at this layout
        other = _policy(hf_dir)
        CheckpointManager(f"{work_dir}/other").load(other, previous_checkpoint, seed=0)
        result["from_previous"] = dict(other.export_hf_weights())
    result["merged"] = merged
    return result, str(checkpoint)


def _job(hf_dir, work_dir):
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(*LAYOUTS[0], seed=5, device="cpu")
    results, checkpoint = {}, None
    for tp, pp in LAYOUTS:
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=5)
        results[(tp, pp)], checkpoint = _layout_run(hf_dir, f"{work_dir}/tp{tp}_pp{pp}", checkpoint)
    return results


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_hf_config()).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def runs(hf_dir, tmp_path_factory):
    """Rank by rank, ``_layout_run``'s results by layout."""
    return run_distributed(_job, 2, hf_dir, str(tmp_path_factory.mktemp("work")))


def _per_rank(runs, layout):
    return [by_layout[layout] for by_layout in runs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_b_is_the_base_exactly_and_only_adapters_train(runs, layout):
    hidden, inter, kv = 64, 128, 2 * 16 * 2  # q: 64, k and v: 2 groups of head_dim 16 each
    qkv_out = hidden + kv
    per_layer = RANK * ((hidden + qkv_out) + (hidden + hidden) + (hidden + 2 * inter) + (inter + hidden))
    for result in _per_rank(runs, layout):
        torch.testing.assert_close(result["start_on"], result["start_off"], atol=0, rtol=0)
        # the base as a separate forward-only engine: the same weights, frozen in both
        torch.testing.assert_close(result["start_off"], result["base"], atol=1e-5, rtol=1e-5)
        assert result["trainable"] == 2 * per_layer  # 2 layers, 4 linears each
        assert result["requires_grad"] and all(name.startswith("lora_adapters.") for name in result["requires_grad"])
        assert result["optimizer_params"] == result["grad_buffer_params"] == result["local_adapter_params"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_grpo_step_moves_the_adapters_only_and_the_reference_stays_the_base(runs, layout):
    for result in _per_rank(runs, layout):
        assert result["base_unchanged"]
        assert (result["after_on"] - result["start_on"]).abs().max() > 1e-3
        torch.testing.assert_close(result["after_off"], result["start_off"], atol=0, rtol=0)
        torch.testing.assert_close(result["merged_engine"], result["after_on"], atol=1e-5, rtol=1e-5)
        assert set(result["checkpoint_keys"]) and all(
            key.startswith(("lora.", "optimizer.")) for key in result["checkpoint_keys"]), result["checkpoint_keys"]
        assert any(key.startswith("lora.") for key in result["checkpoint_keys"])
        for name, value in result["resumed"].items():
            assert torch.equal(value, result["continued"][name]), name
        torch.testing.assert_close(result["checkpoint_as_whole_model"], result["after_on"], atol=1e-5, rtol=1e-5)


def test_dropout_keeps_the_replicas_of_a_whole_adapter_equal_at_tp2(runs):
    for result in _per_rank(runs, (2, 1)):
        assert result["dropout_replicas_equal"] and result["dropout_moved_a"]


def test_the_adapter_update_is_the_same_at_every_layout(runs):
    reference = runs[0][LAYOUTS[0]]
    moved = [name for name, delta in reference["delta"].items() if delta.abs().max() > 1e-4]
    assert len(moved) == 2 * 7  # q, k, v, o, gate, up, down of both layers; embeddings, norms and head do not move
    for layout in LAYOUTS[1:]:
        for result in _per_rank(runs, layout):
            assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
            for name, delta in reference["delta"].items():
                torch.testing.assert_close(result["delta"][name], delta, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_planner_counts_gradients_and_optimizer_state_of_the_adapters_only(runs, layout):
    for result in _per_rank(runs, layout):
        planned, engine = result["planned_static"], result["engine_static"]
        assert planned["grads"] == engine["grads"] and planned["optimizer"] == engine["optimizer"]
        # the frozen base's weights are held all the same; the adapters' Adam moments (8 bytes each) are a sliver
        # of what full training's would be (8 bytes per fp32 parameter: twice the weights' bytes)
        assert planned["params"] >= engine["params"] and 0 < engine["optimizer"] < engine["params"] / 4


def test_the_logged_parameter_figures_count_the_whole_model_at_every_layout(runs):
    """``grpo_mega.perf.parameters``: every layout and rank logs the same whole-model counts (TP shards summed,
    TP-replicated tensors once, both stages): trainable = the adapters, total = the HF model's parameters, the
    embedding and output rows megatron pads the vocabulary with (301 -> 384) and the adapters; the optimizer
    state is the fullest rank's."""
    from transformers import Qwen2ForCausalLM

    hf_params = sum(p.numel() for p in Qwen2ForCausalLM(_hf_config()).parameters())
    padding = (384 - VOCAB) * 64 * 2  # untied: the embedding and the output layer
    for layout in LAYOUTS:
        results = _per_rank(runs, layout)
        for result in results:
            figures = result["figures"]
            assert figures["model/trainable_parameters"] == result["trainable"]
            assert figures["model/total_parameters"] == hf_params + padding + result["trainable"]
            for key, kind in (("parameter_bytes", "parameters"), ("gradient_bytes", "gradients"),
                              ("optimizer_state_bytes", "optimizer_state")):
                assert figures[f"memory/{key}"] == max(r["static"][kind] for r in results)
            # Adam's two fp32 moments of this rank's adapters at least (the distributed optimizer's shard of them at
            # DP=2), a sliver of the frozen base's weights
            data_parallel = 2 // (layout[0] * layout[1])
            assert 8 * result["local_adapter_params"] // data_parallel <= result["static"]["optimizer_state"] < \
                result["static"]["parameters"] / 4


def test_the_merged_weight_is_w_plus_scaled_b_a(runs):
    w, a, b, merged = runs[0][LAYOUTS[0]]["proj"]
    assert b.abs().max() > 0
    torch.testing.assert_close(merged, w + (ALPHA / RANK) * b @ a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_a_checkpoint_resumes_at_another_layout(runs, layout):
    previous = LAYOUTS[LAYOUTS.index(layout) - 1]
    for rank, result in enumerate(_per_rank(runs, layout)):
        for name, value in runs[rank][previous]["merged"].items():
            torch.testing.assert_close(result["from_previous"][name], value, atol=1e-6, rtol=1e-6, msg=name)


# ----------------------------------------------------------------------------- config
def _grpo_config(**lora) -> GRPOConfig:
    cfg = GRPOConfig()
    cfg.model.hf_config, cfg.model.init_from = "/nowhere", "/nowhere"
    for key, value in lora.items():
        setattr(cfg.model.lora, key, value)
    return cfg


@pytest.mark.parametrize("lora, engine, message", [
    ({"rank": -1}, "megatron", "model.lora.rank=-1"),
    ({"rank": 8, "alpha": 0.0}, "megatron", "model.lora.alpha"),
    ({"rank": 8, "dropout": 1.0}, "megatron", "model.lora.dropout"),
    ({"rank": 8, "target_modules": ["q_proj"]}, "megatron", "'q_proj' is Hugging Face's name; megatron's is linear_qkv"),
    ({"rank": 8, "target_modules": ["linear_q"]}, "megatron", "model.lora.target_modules='linear_q'"),
    ({"rank": 8, "target_modules": []}, "megatron", "model.lora.target_modules"),
])
def test_bad_lora_settings_are_refused_in_one_line(lora, engine, message):
    from grpo_mega.config.checks import validate_lora

    cfg = _grpo_config(**lora)
    cfg.engine = engine
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        validate_lora(cfg)
    assert "\n" not in str(error.value)


def test_lora_needs_a_base_and_grpo_or_prm_training():
    from grpo_mega.config.checks import validate_lora
    from grpo_mega.config.sft import SFTConfig

    cfg = _grpo_config(rank=8)
    cfg.model.init_from = None
    with pytest.raises(ConfigError, match="model.init_from"):
        validate_lora(cfg)
    sft = SFTConfig()
    sft.model.lora.rank = 8
    with pytest.raises(ConfigError, match="grpo-mega train"):
        validate_lora(sft)
    validate_lora(_grpo_config(rank=8))  # a GRPO config with a base passes
    from prm.config import PRMConfig

    prm = PRMConfig()
    prm.model.hf_config, prm.model.init_from, prm.model.lora.rank = "/nowhere", "/nowhere", 8
    validate_lora(prm)  # grpo-mega prm train takes LoRA too (tests/test_prm_lora.py)
    prm.engine = "deepspeed"
    with pytest.raises(ConfigError, match="engine=megatron"):
        validate_lora(prm)
    moe = _grpo_config(rank=8)
    moe.model.hf_config = str(REPO / "configs" / "models" / "qwen3-30b-a3b")
    with pytest.raises(ConfigError, match=r"\['linear_fc1', 'linear_fc2'\] are not adapted in a mixture-of-experts"):
        validate_lora(moe)
    moe.model.lora.target_modules = ["linear_qkv", "linear_proj"]
    validate_lora(moe)
    validate_lora(SFTConfig())  # off: nothing to check
