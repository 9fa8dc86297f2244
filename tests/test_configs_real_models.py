"""The shipped real-model GRPO configs (configs/<model>_grpo*.yaml) and their hand-written HF config.json files.

Fast and process-free: each YAML loads and validates, its TP x PP layout fits both the model and the world size
documented in its ``# world_size: N`` comment, its batch sizes split over data parallel, and the architecture in
configs/models/<name> loads with transformers and has the published parameter count.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_mega.config import GRPOConfig, load_config, validate
from grpo_mega.parallel.layout import validate_layout, validate_model_split

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# config file -> (model folder, published parameter count)
REAL_MODEL_CONFIGS = {
    "qwen2.5-math-1.5b_grpo.yaml": ("qwen2.5-math-1.5b", 1.54e9),
    "qwen2.5-math-7b_grpo.yaml": ("qwen2.5-math-7b", 7.6e9),
    "llama-3.1-8b_grpo.yaml": ("llama-3.1-8b", 8.0e9),
    "qwen3-8b_grpo.yaml": ("qwen3-8b", 8.2e9),
    "qwen3-30b-a3b_grpo_2node.yaml": ("qwen3-30b-a3b", 30.5e9),
    "qwen2.5-math-7b_grpo_prm.yaml": ("qwen2.5-math-7b", 7.6e9),
    "qwen2.5-math-7b_grpo_async.yaml": ("qwen2.5-math-7b", 7.6e9),
    "qwen2.5-math-7b_grpo_prm_async.yaml": ("qwen2.5-math-7b", 7.6e9),
    "qwen2.5-math-7b_grpo_implicit.yaml": ("qwen2.5-math-7b", 7.6e9),
    "qwen2.5-math-7b_grpo_lora.yaml": ("qwen2.5-math-7b", 7.6e9),
}
for _multi_node in sorted(CONFIGS.glob("*_2node.yaml")):
    _single = _multi_node.name.replace("_2node", "")
    if _single in REAL_MODEL_CONFIGS:
        REAL_MODEL_CONFIGS[_multi_node.name] = REAL_MODEL_CONFIGS[_single]

# Fields every checked architecture must hold, with the published values.
EXPECTED_ARCHITECTURE = {
    "qwen2.5-math-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                              max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "qwen2.5-math-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                            max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001,
                          vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
                          rms_norm_eps=1e-6),
}

REQUIRED_PATHS = [
    "model.init_from=/models/hf", "model.tokenizer=/models/hf",
    "data.train_file=/data/train.jsonl", "data.eval_file=/data/test.jsonl",
]


def _load(name: str) -> GRPOConfig:
    return load_config(GRPOConfig, CONFIGS / name, REQUIRED_PATHS, validator=validate)


def _world_size(name: str) -> int:
    found = re.findall(r"^# world_size: (\d+)\s*$", (CONFIGS / name).read_text(), flags=re.MULTILINE)
    assert len(found) == 1, f"{name}: needs exactly one '# world_size: N' comment line, found {found}"
    return int(found[0])


def _hf_config(folder: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(CONFIGS / "models" / folder))


def _rope_theta(hf) -> float:
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", None)))


def parameter_count(hf) -> int:
    """Parameters of a Qwen2 / Llama / Qwen3 model from its HF config: embedding, per layer (GQA attention, q/k/v
    bias for qwen2, q/k norms for qwen3, SwiGLU MLP of 3 matrices, 2 RMSNorms), final norm and the LM head unless
    tied."""
    h, layers = hf.hidden_size, hf.num_hidden_layers
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if hf.model_type == "qwen2" else 0)
    attention += 2 * head_dim if hf.model_type in ("qwen3", "qwen3_moe") else 0
    mlp = 3 * h * hf.intermediate_size
    if hf.model_type == "qwen3_moe":  # every layer: a router and the experts instead of one MLP
        mlp = hf.num_experts * (h + 3 * h * hf.moe_intermediate_size)
    per_layer = attention + mlp + 2 * h
    embedding = hf.vocab_size * h
    head = 0 if hf.tie_word_embeddings else hf.vocab_size * h
    return embedding + layers * per_layer + h + head


def test_every_real_model_yaml_is_checked():
    # quickstart and small-model (one CPU or GPU: tests/test_readme_small_model.py runs it) are not 8-GPU configs
    shipped = {p.name for p in CONFIGS.glob("*_grpo*.yaml")} - {"quickstart_grpo.yaml", "small-model_grpo.yaml"}
    assert shipped == set(REAL_MODEL_CONFIGS)


@pytest.mark.parametrize("name", sorted(REAL_MODEL_CONFIGS))
def test_yaml_loads_and_targets_the_model(name):
    cfg = _load(name)
    folder, _ = REAL_MODEL_CONFIGS[name]
    assert Path(cfg.model.hf_config) == Path("configs/models") / folder
    assert (REPO / cfg.model.hf_config / "config.json").is_file()
    assert cfg.rollout.engine == "vllm" and 0 < cfg.rollout.gpu_memory_utilization < 1
    assert cfg.reward.function == "math_verify"
    assert cfg.algorithm.loss_agg_mode == "token-mean"
    assert cfg.algorithm.clip_high == pytest.approx(0.28) and cfg.algorithm.dynamic_sampling
    assert cfg.optim.lr == pytest.approx(1e-5 if cfg.model.lora.enabled else 1e-6)  # LoRA: ~10x
    hf = _hf_config(folder)
    assert cfg.data.prompt_length + cfg.algorithm.response_length <= hf.max_position_embeddings


@pytest.mark.parametrize("name", sorted(REAL_MODEL_CONFIGS))
def test_layout_splits_model_and_world(name):
    cfg = _load(name)
    hf = _hf_config(REAL_MODEL_CONFIGS[name][0])
    tp, pp, world = cfg.parallel.tensor, cfg.parallel.pipeline, _world_size(name)
    # LoRA's config shows the model on fewer GPUs than a node
    assert world % 8 == 0 or cfg.model.lora.enabled, "real-model configs are for whole nodes of 8 GPUs"
    validate_model_split(tp, pp, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    # rollout.mode=async: the last async_ranks GPUs generate, the others train
    generators = cfg.rollout.async_ranks if cfg.rollout.mode == "async" else 0
    layout = validate_layout(tp, pp, world - generators, hf.num_hidden_layers, hf.num_attention_heads,
                             hf.num_key_value_heads)
    alg = cfg.algorithm
    G = alg.num_return_sequences_in_group
    mini = alg.mini_batch_size or alg.rollout_batch_size
    assert alg.rollout_batch_size % mini == 0
    assert (alg.rollout_batch_size * G) % layout.dp == 0
    assert (mini * G) % layout.dp == 0, "every data-parallel rank gets rows of every mini-batch"
    assert (alg.rollout_batch_size * G) % (generators or world) == 0, "generation splits evenly over its ranks"
    # A full-length row fits the micro-batch budget (a longer row would get a micro-batch of its own).
    assert cfg.parallel.max_tokens_per_micro_batch >= cfg.data.prompt_length + alg.response_length


@pytest.mark.parametrize("name", sorted(REAL_MODEL_CONFIGS))
def test_megatron_config_accepts_layout(name):
    from grpo_mega.model import gpt_config_from_hf

    cfg = _load(name)
    folder = REAL_MODEL_CONFIGS[name][0]
    hf = _hf_config(folder)
    gpt = gpt_config_from_hf(hf, tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, ep=cfg.parallel.expert)
    assert gpt.model_type == hf.model_type and gpt.tie_word_embeddings == hf.tie_word_embeddings
    assert gpt.padded_vocab_size % cfg.parallel.tensor == 0 and gpt.padded_vocab_size >= hf.vocab_size
    if hf.model_type == "llama":
        assert gpt.rope_scaling_factor == 8.0 and gpt.rotary_base == 500000.0
    else:
        rotary_base = {"qwen2": 10000.0, "qwen3": 1000000.0, "qwen3_moe": 1000000.0}[hf.model_type]
        assert gpt.rope_scaling_factor is None and gpt.rotary_base == rotary_base
    assert gpt.transformer.qk_layernorm == hf.model_type.startswith("qwen3")


@pytest.mark.parametrize("folder", sorted(EXPECTED_ARCHITECTURE))
def test_hf_config_matches_published_architecture(folder):
    hf = _hf_config(folder)
    for key, value in EXPECTED_ARCHITECTURE[folder].items():
        assert getattr(hf, key) == value, f"{folder}: {key}={getattr(hf, key)!r}, expected {value!r}"
    assert hf.hidden_act == "silu"
    assert _rope_theta(hf) == {"llama": 500000.0, "qwen2": 10000.0, "qwen3": 1000000.0,
                               "qwen3_moe": 1000000.0}[hf.model_type]
    if hf.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        assert not getattr(hf, "use_sliding_window", False)


@pytest.mark.parametrize("folder, expected", [
    ("qwen2.5-math-1.5b", 1.54e9), ("qwen2.5-math-7b", 7.6e9), ("llama-3.1-8b", 8.0e9), ("qwen3-8b", 8.2e9),
    ("qwen3-30b-a3b", 30.5e9),
])
def test_parameter_count_matches_published_size(folder, expected):
    count = parameter_count(_hf_config(folder))
    assert abs(count - expected) / expected < 0.02, f"{folder}: {count / 1e9:.3f}B, expected ~{expected / 1e9}B"


def test_layout_check_rejects_a_split_the_model_does_not_allow():
    hf = _hf_config("qwen2.5-math-7b")  # 28 heads, 4 kv heads: TP8 cannot hold whole heads
    with pytest.raises(ValueError, match="num_attention_heads=28"):
        validate_model_split(8, 1, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    with pytest.raises(ValueError, match="world_size 8 is not a multiple"):
        validate_layout(4, 4, 8, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)


def test_process_supervised_config_scores_steps_with_qwen_math_prm():
    from transformers import AutoConfig

    from grpo_mega.checkpoint.hf_layouts import architecture_for
    from prm.spec import detect_layout

    cfg = _load("qwen2.5-math-7b_grpo_prm.yaml")
    assert cfg.algorithm.supervision == "process" and cfg.process_reward.source == "prm"
    assert cfg.process_reward.step_tag == "<extra_0>" and cfg.process_reward.step_pattern == "\n\n"
    assert cfg.process_reward.chat_template and "\\boxed{}" in cfg.process_reward.system_prompt
    prm = AutoConfig.from_pretrained(str(CONFIGS / "models" / "qwen2.5-math-prm-7b"))
    assert detect_layout(prm) == "classifier"
    assert architecture_for(prm).architecture == "Qwen2ForProcessRewardModel"
    # the PRM runs at the policy's layout: it must split the same way
    validate_model_split(cfg.parallel.tensor, cfg.parallel.pipeline, prm.num_hidden_layers, prm.num_attention_heads,
                         prm.num_key_value_heads)
    # the Qwen2.5-Math-7B backbone without its LM head (152064 x 3584) plus the score head (~12.8M): ~7.07B
    h = prm.hidden_size
    count = parameter_count(prm) - prm.vocab_size * h + (h * h + h + 2 * h + 2)
    assert abs(count - 7.07e9) / 7.07e9 < 0.01, count
