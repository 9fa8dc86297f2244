"""Which transformer layers the model is built from: Transformer Engine only when megatron-core's own check loads
it (``megatron.core.extensions.transformer_engine.HAVE_TE``, which imports TE's compiled extension), else the
local layers, with one log line saying why (issue 29, defect 4). This machine has no GPU and no TE."""

from __future__ import annotations

import logging

import pytest

import grpo_mega.model.gpt as gpt


@pytest.fixture
def fresh_choice():
    gpt._use_transformer_engine.cache_clear()
    yield
    gpt._use_transformer_engine.cache_clear()


def test_cpu_never_uses_transformer_engine():
    assert gpt.transformer_engine_unavailable("cpu") == "no CUDA device"


def test_gpu_without_a_loadable_transformer_engine_gets_the_local_layers_with_the_reason(fresh_choice, caplog):
    from megatron.core.extensions import transformer_engine as te_extension

    assert not te_extension.HAVE_TE  # megatron's check fails here: the premise of this test
    reason = gpt.transformer_engine_unavailable("cuda")
    assert "megatron-core cannot import it" in reason and "transformer_engine" in reason
    with caplog.at_level(logging.INFO, logger="grpo_mega.model.gpt"):
        assert gpt._use_transformer_engine("cuda") is False
        assert gpt._use_transformer_engine("cuda") is False  # decided and logged once per process
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_mega.model.gpt"]
    assert len(lines) == 1 and "local layers" in lines[0] and reason in lines[0]


def test_transformer_engine_choice_says_shared_prompt_packing_is_off(fresh_choice, caplog, monkeypatch):
    monkeypatch.setattr(gpt, "transformer_engine_unavailable", lambda device_type: None)
    with caplog.at_level(logging.INFO, logger="grpo_mega.model.gpt"):
        assert gpt._use_transformer_engine("cuda") is True
    (line,) = [r.getMessage() for r in caplog.records if r.name == "grpo_mega.model.gpt"]
    assert "Transformer Engine" in line and "parallel.share_prompt_prefix" in line and "off" in line


def test_local_spec_on_cpu_uses_torch_fused_attention(fresh_choice):
    from grpo_mega.model.attention import SDPADotProductAttention

    spec = gpt.transformer_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is SDPADotProductAttention


def test_local_spec_has_rms_q_k_norms_only_for_a_model_that_has_them(fresh_choice):
    from megatron.core.transformer.identity_op import IdentityOp
    from transformers import Qwen2Config, Qwen3Config

    from grpo_mega.model import gpt_config_from_hf
    from grpo_mega.model.norm import RMSNorm

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    qwen3 = gpt.transformer_layer_spec(gpt_config_from_hf(Qwen3Config(**shape)).transformer)
    qwen2 = gpt.transformer_layer_spec(gpt_config_from_hf(Qwen2Config(**shape)).transformer)
    for name in ("q_layernorm", "k_layernorm"):
        assert getattr(qwen3.submodules.self_attention.submodules, name) is RMSNorm
        assert getattr(qwen2.submodules.self_attention.submodules, name) is IdentityOp
