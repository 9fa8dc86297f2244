"""HF <-> megatron-core conversion: layouts, TP/PP sharding, logits against transformers, tools.

Models are random Qwen2 / Llama / Qwen3 models built locally by transformers: multi-head and GQA with 2 and
4 query heads per key/value head, tied and untied embeddings, vocabularies that need padding, Qwen3's q/k norms
with a head_dim that is not hidden / heads. All
weights (norms included) are perturbed, so a swapped or mis-sliced tensor changes the logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from grpo_mega.checkpoint import (
    HFWeights,
    SafetensorsShardWriter,
    architecture_for,
    hf_to_mcore_shards,
    mcore_shards_to_hf,
)
from grpo_mega.checkpoint.hf_layouts import FUSED_NORM_NAMES, model_tensor_name
from grpo_mega.checkpoint.hf_transforms import GATE_UP, QKV_GROUPED, VOCAB_ROWS, ModelDims

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=128)
CONFIGS = {
    # GQA ratio 1 (multi-head), untied, vocabulary 301 -> padded 384.
    "qwen2_mha_untied": lambda: Qwen2Config(vocab_size=301, num_attention_heads=4,
                                            num_key_value_heads=4, tie_word_embeddings=False, **SMALL),
    # GQA ratio 2, tied.
    "qwen2_gqa2_tied": lambda: Qwen2Config(vocab_size=301, num_attention_heads=4,
                                           num_key_value_heads=2, tie_word_embeddings=True, **SMALL),
    # GQA ratio 4, head_dim not hidden/heads, untied, vocabulary 257.
    "llama_gqa4_untied": lambda: LlamaConfig(vocab_size=257, num_attention_heads=8, num_key_value_heads=2,
                                             head_dim=16, tie_word_embeddings=False, **SMALL),
    # GQA ratio 4, tied, with q/k/v/o biases.
    "llama_gqa4_tied_bias": lambda: LlamaConfig(vocab_size=257, num_attention_heads=8,
                                                num_key_value_heads=2, tie_word_embeddings=True,
                                                attention_bias=True, **SMALL),
    # Qwen3: q/k RMSNorm on every head, head_dim 32 with hidden 64 and 4 heads (q_size 128 > hidden), tied.
    "qwen3_gqa2_tied_qknorm": lambda: Qwen3Config(vocab_size=301, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=32, tie_word_embeddings=True, **SMALL),
    # Qwen3, GQA ratio 4, untied.
    "qwen3_gqa4_untied_qknorm": lambda: Qwen3Config(vocab_size=257, num_attention_heads=8, num_key_value_heads=2,
                                                    head_dim=16, tie_word_embeddings=False, **SMALL),
}
# Only in the process-free tests: megatron models built by grpo_mega.model have no o_proj / MLP bias.
TABLE_ONLY = {
    "llama_mlp_bias": lambda: LlamaConfig(vocab_size=257, num_attention_heads=4, num_key_value_heads=2,
                                          attention_bias=True, mlp_bias=True, **SMALL),
}
MODEL_CONFIGS = ("qwen2_mha_untied", "qwen2_gqa2_tied", "llama_gqa4_untied", "qwen3_gqa2_tied_qknorm")


def random_hf_model(config, seed: int = 0):
    """A transformers model with every weight random: norms 1 + N(0, 0.1^2), the rest N(0, 0.1^2)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1)
            if "norm" in name:
                param.add_(1.0)
    return model


def hf_weights(config_name: str) -> tuple[object, dict[str, torch.Tensor]]:
    config = {**CONFIGS, **TABLE_ONLY}[config_name]()
    return config, dict(random_hf_model(config).state_dict())


def shard_all(state, config, tp: int, pp: int, padded: int | None = None):
    return {(t, p): hf_to_mcore_shards(state, config, t, tp, p, pp, padded_vocab_size=padded)
            for t in range(tp) for p in range(pp)}


# ---------------------------------------------------------------------------------------------
# Layouts and tables, no processes


@pytest.mark.parametrize("config_name", [*CONFIGS, *TABLE_ONLY])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_identical(config_name, tp, pp):
    config, state = hf_weights(config_name)
    back = mcore_shards_to_hf(shard_all(state, config, tp, pp), config, tp, pp)
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in back  # the tied head is the embedding: not written twice
        state.pop("lm_head.weight")
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_round_trip_at_tp4_pp4():
    config, state = hf_weights("qwen2_mha_untied")
    back = mcore_shards_to_hf(shard_all(state, config, 4, 4), config, 4, 4)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_qkv_is_interleaved_per_query_group():
    # 4 query heads, 2 groups, head_dim 1: q = [0, 1, 2, 3], k = [10, 11], v = [20, 21].
    dims = ModelDims(1, 1, 4, 2, 1, 4, 8, 8, False)
    q, k, v = torch.arange(4.0), torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    full = QKV_GROUPED.to_mcore([q, k, v], dims, 0, 1)
    assert full.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert QKV_GROUPED.to_mcore([q, k, v], dims, 1, 2).tolist() == [2, 3, 11, 21]
    shards = [QKV_GROUPED.to_mcore([q, k, v], dims, r, 2) for r in range(2)]
    assert [t.tolist() for t in QKV_GROUPED.to_hf(shards, dims)] == [q.tolist(), k.tolist(), v.tolist()]


def test_gate_up_is_merged_per_tensor_parallel_shard():
    dims = ModelDims(1, 1, 1, 1, 1, 4, 8, 8, False)
    gate, up = torch.arange(4.0), torch.arange(10.0, 14.0)
    assert GATE_UP.to_mcore([gate, up], dims, 0, 1).tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert GATE_UP.to_mcore([gate, up], dims, 0, 2).tolist() == [0, 1, 10, 11]
    assert GATE_UP.to_mcore([gate, up], dims, 1, 2).tolist() == [2, 3, 12, 13]


def test_vocab_rows_are_zero_padded_and_trimmed_on_export():
    dims = ModelDims(1, 2, 1, 1, 2, 4, vocab_size=5, padded_vocab_size=8, tie_word_embeddings=False)
    table = torch.arange(10.0).reshape(5, 2) + 1
    shards = [VOCAB_ROWS.to_mcore([table], dims, r, 2) for r in range(2)]
    assert torch.equal(shards[0], table[:4])
    assert torch.equal(shards[1][0], table[4]) and not shards[1][1:].any()
    assert torch.equal(VOCAB_ROWS.to_hf(shards, dims)[0], table)


def test_pipeline_stages_hold_their_global_layers():
    config, state = hf_weights("qwen2_gqa2_tied")
    stage1 = hf_to_mcore_shards(state, config, 0, 1, 1, 2)
    # Stage 1 of 2 holds HF layers 2, 3 as its local layers 0, 1, and the final norm.
    assert torch.equal(stage1["decoder.layers.0.input_layernorm.weight"],
                       state["model.layers.2.input_layernorm.weight"])
    assert "decoder.layers.2.input_layernorm.weight" not in stage1
    assert "embedding.word_embeddings.weight" not in stage1
    assert torch.equal(stage1["decoder.final_layernorm.weight"], state["model.norm.weight"])
    # Tied: megatron keeps a copy of the embedding as the last stage's output layer ...
    assert torch.equal(stage1["output_layer.weight"][:301], state["model.embed_tokens.weight"])
    # ... and none when one stage holds both.
    assert "output_layer.weight" not in hf_to_mcore_shards(state, config, 0, 1, 0, 1)


def test_fused_norm_names_of_transformer_engine_layers():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # megatron pairs the local spec's norm modules with the fused names the same way.
    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    assert {(local, fused) for local, fused in FUSED_NORM_NAMES} == {
        (local + "weight", fused + "weight") for local, fused in keys_map.items()
    }
    fused_model = {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
                   "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", "decoder.final_layernorm.weight"}
    assert (model_tensor_name("decoder.layers.3.input_layernorm.weight", fused_model)
            == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    assert (model_tensor_name("decoder.layers.3.pre_mlp_layernorm.weight", fused_model)
            == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight")
    assert model_tensor_name("decoder.final_layernorm.weight", fused_model) == "decoder.final_layernorm.weight"
    local_model = {"decoder.layers.3.input_layernorm.weight"}
    assert (model_tensor_name("decoder.layers.3.input_layernorm.weight", local_model)
            == "decoder.layers.3.input_layernorm.weight")


# ---------------------------------------------------------------------------------------------
# Errors


def test_unsupported_architecture_names_model_type():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        architecture_for(GPT2Config())
    with pytest.raises(ValueError, match="gpt2"):
        hf_to_mcore_shards({}, GPT2Config(), 0, 1, 0, 1)


def test_config_that_does_not_match_the_weights():
    config, state = hf_weights("qwen2_gqa2_tied")
    bigger = Qwen2Config(**{**config.to_dict(), "intermediate_size": 128})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight.*\(96, 64\).*\(128, 64\)"):
        hf_to_mcore_shards(state, bigger, 0, 1, 0, 1)
    missing = {k: v for k, v in state.items() if k != "model.layers.3.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.3.self_attn.k_proj.bias'\]"):
        hf_to_mcore_shards(missing, config, 0, 1, 0, 1)
    llama, biased = hf_weights("llama_gqa4_tied_bias")
    no_bias = LlamaConfig(**{**llama.to_dict(), "attention_bias": False})
    with pytest.raises(ValueError, match=r"not in the llama table.*o_proj.bias"):
        hf_to_mcore_shards(biased, no_bias, 0, 1, 0, 1)


def test_tensor_parallel_that_does_not_divide_heads():
    config, state = hf_weights("qwen2_mha_untied")
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide num_attention_heads=4"):
        hf_to_mcore_shards(state, config, 0, 3, 0, 1)
    with pytest.raises(ValueError, match="pipeline_parallel=3 does not divide num_layers=4"):
        hf_to_mcore_shards(state, config, 0, 1, 0, 3)


def test_missing_megatron_shard():
    config, state = hf_weights("qwen2_mha_untied")
    shards = shard_all(state, config, 2, 1)
    del shards[(1, 0)]["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match=r"linear_fc2.weight.*tp_rank=1, pp_rank=0 is missing"):
        mcore_shards_to_hf(shards, config, 2, 1)


def test_hf_folder_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=f"{tmp_path} holds no safetensors weights"):
        HFWeights(tmp_path)


# ---------------------------------------------------------------------------------------------
# HF folders


def test_sharded_writer_round_trip(tmp_path):
    config = CONFIGS["qwen2_gqa2_tied"]()
    model = random_hf_model(config)
    writer = SafetensorsShardWriter(tmp_path, max_shard_bytes=40_000)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            writer.add(name, tensor)
    with pytest.raises(ValueError, match="added twice"):
        writer.add("model.norm.weight", torch.zeros(64))
    files = writer.close()
    assert len(files) > 3 and (tmp_path / "model.safetensors.index.json").is_file()
    config.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    lazy = HFWeights(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
        if name != "lm_head.weight":
            assert lazy.shape_of(name) == tuple(tensor.shape) and torch.equal(lazy[name], tensor)
    with pytest.raises(ValueError, match="already holds safetensors"):
        SafetensorsShardWriter(tmp_path)


# ---------------------------------------------------------------------------------------------
# Running models: TP=1 (DP=2), TP=2, PP=2 on 2 gloo processes


def _use_layout(tp: int, pp: int) -> None:
    """Re-create megatron's model-parallel groups over the already running 2-process job."""
    from megatron.core import parallel_state

    from grpo_mega.parallel import seed_everything

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    seed_everything(0)


def _check_against_hf(model, config, hf_dir: str) -> dict:
    """Logit difference to transformers and, per HF tensor, whether export gives it back exactly."""
    from grpo_mega.checkpoint import export_hf_weights, mcore_logits

    weights = HFWeights(hf_dir)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = mcore_logits(model, ids)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
    exported = {name: torch.equal(tensor, weights[name]) for name, tensor in export_hf_weights(model, config)}
    return {
        "max_diff": (logits - expected).abs().max().item(),
        "logit_scale": expected.abs().max().item(),
        "exported": exported,
        "hf_names": sorted(weights),
    }


def _logits_and_export(hf_dirs: dict[str, str], ckpt_dir: str) -> dict:
    from transformers import AutoConfig

    from grpo_mega.checkpoint import load_hf_weights, load_mcore_checkpoint, save_mcore_checkpoint
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.parallel import init_distributed

    def build(config, tp, pp):
        return build_gpt_model(gpt_config_from_hf(config, tp=tp, pp=pp,
                                                  overrides={"perform_initialization": False}))

    init_distributed(1, 1, seed=0, device="cpu")
    results = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        _use_layout(tp, pp)
        for name, hf_dir in hf_dirs.items():
            config = AutoConfig.from_pretrained(hf_dir)
            model = build(config, tp, pp)
            load_hf_weights(model, HFWeights(hf_dir), config)
            results[(name, tp, pp)] = _check_against_hf(model, config, hf_dir)
            if (name, tp, pp) == ("qwen2_gqa2_tied", 2, 1):
                save_mcore_checkpoint(model, ckpt_dir, hf_dir)

    # Saved at TP=2, loaded at PP=2 into a stage with a head of its own: the head is not touched.
    hf_dir = hf_dirs["qwen2_gqa2_tied"]
    config = AutoConfig.from_pretrained(hf_dir)
    model = build(config, 1, 2)
    model.head = torch.nn.Linear(4, 1)
    torch.nn.init.constant_(model.head.weight, 0.5)
    load_mcore_checkpoint(model, ckpt_dir)
    results["mcore checkpoint tp2 -> pp2"] = _check_against_hf(model, config, hf_dir)
    assert torch.equal(model.head.weight, torch.full((1, 4), 0.5))
    return results


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    dirs = {}
    for name in MODEL_CONFIGS:
        random_hf_model(CONFIGS[name]()).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def test_logits_match_hf_and_export_is_bit_identical(hf_dirs, tmp_path):
    results = run_distributed(_logits_and_export, 2, hf_dirs, str(tmp_path / "ckpt"))
    for rank_results in results:
        assert len(rank_results) == 3 * len(MODEL_CONFIGS) + 1
        for key, result in rank_results.items():
            assert result["logit_scale"] > 0.5, key  # logits of a size where 1e-4 means something
            assert result["max_diff"] < 1e-4, key
            assert sorted(result["exported"]) == result["hf_names"], key
            assert all(result["exported"].values()), key


# ---------------------------------------------------------------------------------------------
# Tools end to end


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def _tiny_model_with_tokenizer(folder: Path, seed: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = CONFIGS["qwen2_gqa2_tied"]()
    random_hf_model(config, seed).save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(301)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(folder)


def test_tools_end_to_end(tmp_path):
    hf, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_back"
    _tiny_model_with_tokenizer(hf, seed=0)

    done = _tool("convert_hf_to_mcore.py", "--hf", str(hf), "--out", str(ckpt))
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr  # the known-harmless megatron / Apex warnings are filtered
    assert (ckpt / "grpo_mega_model.json").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()

    # Saved at TP=1, read back at TP=2: dist_checkpointing reshards (TP=2 -> PP=2 is tested above).
    done = _tool("convert_mcore_to_hf.py", "--ckpt", str(ckpt), "--out", str(back), "--tp", "2",
                 "--max-shard-gb", "0.0001")
    assert done.returncode == 0, done.stderr
    original = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).state_dict()
    assert set(original) == set(reloaded)
    assert all(torch.equal(original[name], reloaded[name]) for name in original)
    assert len(list(back.glob("model-*.safetensors"))) > 1
    assert (back / "tokenizer.json").read_text() == (hf / "tokenizer.json").read_text()

    done = _tool("compare_with_hf.py", "--hf", str(hf), "--ckpt", str(ckpt),
                 "--text", "w1 w5 w7 w100 w300")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "next-token agreement  100.00% of 5 positions" in done.stdout


def test_compare_report_fails_for_another_model(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    from compare_with_hf import judged, report

    config = CONFIGS["qwen2_gqa2_tied"]()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [random_hf_model(config, seed)(ids).logits for seed in (0, 0, 1)]
    same = judged(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    other = judged(logits[0], logits[2], atol=1e-4, rtol=1e-4)
    assert same["max_abs_diff"] == 0.0 and same["next_token_agreement"] == 1.0
    assert same["min_cosine"] == pytest.approx(1.0)
    assert other["max_abs_diff"] > 0.1 and other["next_token_agreement"] < 0.5
    assert report(same)[1]
    lines, passed = report(other)
    assert not passed and lines[-2].startswith("FAIL: max |logit diff|") and "greedy next token" in lines[-1]


def test_tools_reject_bad_input(tmp_path, monkeypatch):
    # In-process: the tools check their input before starting any process.
    monkeypatch.syspath_prepend(str(TOOLS))
    import compare_with_hf
    import convert_hf_to_mcore
    import convert_mcore_to_hf

    hf = tmp_path / "hf"
    _tiny_model_with_tokenizer(hf, seed=0)
    cases = [
        (convert_hf_to_mcore, ["--hf", str(hf), "--out", str(tmp_path / "x"), "--tp", "3"],
         "tensor_parallel=3 does not divide num_attention_heads=4"),
        (convert_hf_to_mcore, ["--hf", str(tmp_path), "--out", str(tmp_path / "x")], "no config.json"),
        (convert_hf_to_mcore, ["--hf", str(hf), "--out", str(tmp_path)], "is not empty"),
        (convert_mcore_to_hf, ["--ckpt", str(hf), "--out", str(tmp_path / "y")],
         "grpo_mega_model.json is missing"),
        (compare_with_hf, ["--hf", str(hf), "--ckpt", str(hf)], "grpo_mega_model.json is missing"),
    ]
    for tool, argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            tool.main(argv)
        assert message in str(exit_info.value.code), (argv, exit_info.value.code)
