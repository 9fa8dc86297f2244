"""``tools/convert_mcore_to_hf.py`` on a LoRA run's checkpoint (adapters only): merged weights by default, and with
``--peft-adapter`` a PEFT adapter folder that ``peft.PeftModel.from_pretrained(base, folder)`` loads on the CPU and
whose logits equal the merged export's, read at TP=1, TP=2 (B of the fused qkv / gate-up linears gathered and
split into q/k/v and gate/up, A of o_proj / down_proj gathered) and PP=2 with the same tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

TOOLS = Path(__file__).resolve().parent.parent / "tools"
RANK, ALPHA = 4, 8.0
HF_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _hf_config():
    return tiny_qwen2_config(tied=False, num_layers=2)


def _save_lora_checkpoint(hf_dir: str, run_dir: str) -> str:
    """One process: a LoRA policy on the base ``hf_dir`` whose adapters (B too) are random, saved as a checkpoint."""
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import OptimConfig
    from grpo_mega.config.lora import LoRAConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.lora import lora_attacher
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=3, device="cpu")
    policy = build_policy_engine(
        _hf_config(), optim=OptimConfig(lr=1e-2), total_steps=1, max_tokens_per_micro_batch=64,
        attach_adapters=lora_attacher(LoRAConfig(rank=RANK, alpha=ALPHA), seed=7, base=hf_dir))
    load_initial_weights(policy, hf_dir)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B = 0 would make every export the base: adapters as after some training
        for param in policy.lora.modules.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    folder = CheckpointManager(run_dir).save(policy, 1, config={"model": {"hf_config": hf_dir,
                                                                          "init_from": hf_dir}})
    return str(folder), _classifier_on_a_policy_checkpoint(hf_dir, run_dir)


def _classifier_on_a_policy_checkpoint(hf_dir: str, run_dir: str) -> dict:
    """A LoRA PRM's base may be a policy's whole-model checkpoint: a classifier PRM's stage (no LM head) reads its
    backbone (``load_stage_weights``). Returns the largest difference from the HF policy per exported tensor."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from grpo_mega.checkpoint.hf_convert import export_hf_weights
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.source import resolve_model_source
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.engine.source_weights import load_stage_weights
    from prm.export import conversion_stage
    from prm.spec import prm_hf_config_from_policy

    plain = build_policy_engine(_hf_config(), optim=OptimConfig(lr=1e-2), total_steps=1, max_tokens_per_micro_batch=64)
    load_initial_weights(plain, hf_dir)
    whole = CheckpointManager(f"{run_dir}/whole").save(plain, 1, config={"model": {"hf_config": hf_dir}})
    classifier = AutoConfig.from_pretrained(prm_hf_config_from_policy(hf_dir, f"{run_dir}/classifier", "classifier"))
    stage = conversion_stage(classifier, "float32")
    load_stage_weights(stage, resolve_model_source(whole))
    policy = load_file(f"{hf_dir}/model.safetensors")
    return {name: (tensor - policy[name]).abs().max().item() if name in policy else None
            for name, tensor in export_hf_weights(stage, classifier)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    hf_dir = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_hf_config()).save_pretrained(hf_dir)
    run_dir = tmp_path_factory.mktemp("run")
    folder, classifier = run_distributed(_save_lora_checkpoint, 1, str(hf_dir), str(run_dir))[0]
    return hf_dir, Path(folder), classifier


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
def test_the_peft_adapter_loads_onto_the_base_and_equals_the_merged_export(checkpoint, tmp_path, monkeypatch,
                                                                           capsys):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(TOOLS))
    import convert_mcore_to_hf

    hf_dir, ckpt, _ = checkpoint
    merged, adapter1, adapter2 = tmp_path / "merged", tmp_path / "peft_tp1", tmp_path / "peft_tp2"
    adapter_pp2 = tmp_path / "peft_pp2"
    convert_mcore_to_hf.main(["--ckpt", str(ckpt), "--out", str(merged), "--tp", "2"])
    convert_mcore_to_hf.main(["--ckpt", str(ckpt), "--out", str(adapter1), "--peft-adapter"])
    convert_mcore_to_hf.main(["--ckpt", str(ckpt), "--out", str(adapter2), "--peft-adapter", "--tp", "2"])
    convert_mcore_to_hf.main(["--ckpt", str(ckpt), "--out", str(adapter_pp2), "--peft-adapter", "--pp", "2"])
    assert "PEFT adapter of" in capsys.readouterr().out

    config = json.loads((adapter1 / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert config["target_modules"] == HF_TARGETS and config["base_model_name_or_path"] == str(hf_dir)
    assert not (adapter1 / "config.json").exists()
    at_tp1, at_tp2, at_pp2 = (load_file(str(folder / "adapter_model.safetensors"))
                              for folder in (adapter1, adapter2, adapter_pp2))
    assert len(at_tp1) == 2 * len(HF_TARGETS) * 2  # A and B of 7 modules in 2 layers
    assert at_tp1["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, RANK)
    assert at_tp1["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (RANK, 128)
    for other in (at_tp2, at_pp2):  # gathered over TP, and over the pipeline stages
        assert at_tp1.keys() == other.keys() and all(torch.equal(at_tp1[k], other[k]) for k in at_tp1)

    ids = torch.randint(0, 301, (3, 17), generator=torch.Generator().manual_seed(5))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    base_logits = _logits(base, ids)
    expected = _logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
    assert (expected - base_logits).abs().max() > 0.1  # the adapters change the model
    for folder in (adapter1, adapter2):
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                               folder)
        # x (W + s B A)^T against x W^T + s (x A^T) B^T: fp32 rounding only (logits of size ~10 here)
        torch.testing.assert_close(_logits(peft_model, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_classifier_prm_reads_the_backbone_of_a_policy_training_checkpoint(checkpoint):
    differences = checkpoint[2]
    assert {name for name, diff in differences.items() if diff is None} == {"score.0.weight", "score.0.bias",
                                                                           "score.2.weight", "score.2.bias"}
    assert "model.layers.1.mlp.down_proj.weight" in differences
    assert all(diff == 0.0 for diff in differences.values() if diff is not None)
