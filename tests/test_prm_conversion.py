"""HF <-> megatron conversion of the classifier PRM layout (Qwen2ForProcessRewardModel): its table (Qwen2 without
lm_head, plus score.* as the replicated head on the last stage), errors, and the tools' round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_prm_model import SHAPE, write_classifier_prm
from transformers import LlamaConfig, Qwen2Config

from grpo_mega.checkpoint import architecture_for, hf_to_mcore_shards, mcore_shards_to_hf
from grpo_mega.checkpoint.hf_layouts import QWEN2, QWEN2_PRM_CLASSIFIER

TOOLS = Path(__file__).resolve().parents[1] / "tools"
HEAD = {"head.score.0.weight": "score.0.weight", "head.score.0.bias": "score.0.bias",
        "head.score.2.weight": "score.2.weight", "head.score.2.bias": "score.2.bias"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = write_classifier_prm(tmp_path_factory.mktemp("prm") / "classifier", seed=0)
    return folder, Qwen2Config.from_pretrained(folder), load_file(str(folder / "model.safetensors"))


def test_the_architecture_chooses_the_classifier_table():
    assert architecture_for(Qwen2Config(architectures=["Qwen2ForProcessRewardModel"])) is QWEN2_PRM_CLASSIFIER
    assert architecture_for(Qwen2Config(architectures=["Qwen2ForCausalLM"])) is QWEN2
    assert architecture_for(Qwen2Config()) is QWEN2
    assert not QWEN2_PRM_CLASSIFIER.lm_output and QWEN2_PRM_CLASSIFIER.label == "qwen2 (Qwen2ForProcessRewardModel)"
    with pytest.raises(ValueError, match="'Qwen2ForProcessRewardModel' is a qwen2 model, but the config has "
                                         "model_type 'llama'"):
        architecture_for(LlamaConfig(architectures=["Qwen2ForProcessRewardModel"]))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_classifier_round_trip_is_bit_identical(classifier, tp, pp):
    _, config, state = classifier
    shards = {(t, p): hf_to_mcore_shards(state, config, t, tp, p, pp) for t in range(tp) for p in range(pp)}
    for (t, p), shard in shards.items():
        assert not any(name.startswith("output_layer.") for name in shard)
        if p == pp - 1:  # the head lives on the last stage, whole on every TP rank
            for mcore, hf in HEAD.items():
                assert torch.equal(shard[mcore], state[hf]), (t, p, mcore)
        else:
            assert not any(name.startswith("head.") for name in shard)
    back = mcore_shards_to_hf(shards, config, tp, pp)
    assert set(back) == set(state) and "lm_head.weight" not in back
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_classifier_weights_that_do_not_fit(classifier):
    _, config, state = classifier
    with_lm_head = {**state, "lm_head.weight": torch.zeros(301, 64)}
    with pytest.raises(ValueError, match=r"not in the qwen2 \(Qwen2ForProcessRewardModel\) table \['lm_head.weight'\]"):
        hf_to_mcore_shards(with_lm_head, config, 0, 1, 0, 1)
    without_head = {name: t for name, t in state.items() if not name.startswith("score.2")}
    with pytest.raises(ValueError, match=r"missing \['score.2.bias', 'score.2.weight'\]"):
        hf_to_mcore_shards(without_head, config, 0, 1, 0, 1)
    three_classes = {**state, "score.2.weight": torch.zeros(3, 64)}
    with pytest.raises(ValueError, match=r"'score.2.weight' has shape \(3, 64\) but the config implies \(2, 64\)"):
        hf_to_mcore_shards(three_classes, config, 0, 1, 0, 1)
    # A causal LM's weights are not a classifier PRM: its config (no PRM architecture) says so.
    policy = Qwen2Config(**SHAPE, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"not in the qwen2 table \['score.0.bias'"):
        hf_to_mcore_shards(state, policy, 0, 1, 0, 1)


def test_tools_round_trip_of_the_classifier_is_bit_identical(classifier, tmp_path, monkeypatch, capsys):
    # In this process (each tool still starts its tp*pp ranks): one interpreter start less per tool.
    monkeypatch.syspath_prepend(str(TOOLS))
    import convert_hf_to_mcore
    import convert_mcore_to_hf

    folder, _, state = classifier
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    convert_hf_to_mcore.main(["--hf", str(folder), "--out", str(ckpt), "--tp", "2"])
    assert "qwen2 (Qwen2ForProcessRewardModel)" in capsys.readouterr().out
    info = json.loads((ckpt / "grpo_mega_model.json").read_text())
    assert info["architectures"] == ["Qwen2ForProcessRewardModel"] and info["saved_tensor_parallel"] == 2
    # Saved at TP=2, read at PP=2: the head comes from the last stage.
    convert_mcore_to_hf.main(["--ckpt", str(ckpt), "--out", str(back), "--pp", "2"])
    exported = load_file(str(back / "model.safetensors"))
    assert set(exported) == set(state)
    assert all(torch.equal(exported[name], tensor) for name, tensor in state.items())
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForProcessRewardModel"]
    assert config == json.loads((folder / "config.json").read_text())
    assert (back / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_qwen3_classifier_round_trips_with_its_q_k_norms(tp, pp):
    from transformers import Qwen3Config, Qwen3Model

    from grpo_mega.checkpoint.hf_layouts import QWEN3_PRM_CLASSIFIER

    config = Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=False, architectures=["Qwen3ForProcessRewardModel"])
    assert architecture_for(config) is QWEN3_PRM_CLASSIFIER
    torch.manual_seed(0)
    state = {f"model.{name}": torch.randn(t.shape) for name, t in Qwen3Model(config).state_dict().items()}
    state.update({"score.0.weight": torch.randn(64, 64), "score.0.bias": torch.randn(64),
                  "score.2.weight": torch.randn(2, 64), "score.2.bias": torch.randn(2)})
    assert "model.layers.0.self_attn.q_norm.weight" in state
    shards = {(t, p): hf_to_mcore_shards(state, config, t, tp, p, pp) for t in range(tp) for p in range(pp)}
    assert any("self_attention.k_layernorm.weight" in name for shard in shards.values() for name in shard)
    back = mcore_shards_to_hf(shards, config, tp, pp)
    assert set(back) == set(state) and all(torch.equal(back[name], t) for name, t in state.items())
