"""LoRA on the DeepSpeed engine (``model.lora`` with ``engine: deepspeed``, peft's adapters on the HF model), at
ZeRO-2 and ZeRO-3: a step changes the adapters only; the reference (adapters off) is the base exactly; the weights
synced to the rollout engine are merged (HF names, no ``lora_`` tensor) and give the adapted model's log-probs in
plain transformers; a checkpoint holds the adapters only, a step after resume repeats the uninterrupted one bit for
bit, and the checkpoint read as whole weights (``model.init_from``) is the base with the adapters merged in.

One spawn of 2 gloo processes (DeepSpeed's CPU accelerator) runs both stages in turn."""

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

pytest.importorskip("deepspeed")
pytest.importorskip("peft")

VOCAB = 301
RANK, ALPHA = 4, 8.0


def _batch(rows, seed):
    from test_engine_deepspeed import _batch as grpo_batch

    return grpo_batch(rows=rows, seed=seed, vocab=VOCAB)


def _policy(hf_config, hf_dir, stage, rank=RANK):
    from test_engine_deepspeed import _optim

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import DeepSpeedConfig
    from grpo_mega.config.lora import LoRAConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.lora import lora_attacher

    policy = build_policy_engine(
        hf_config, optim=_optim(), total_steps=4, max_tokens_per_micro_batch=40, engine_kind="deepspeed",
        deepspeed=DeepSpeedConfig(zero_stage=stage, gather_bucket_mb=1),
        attach_adapters=lora_attacher(LoRAConfig(rank=rank, alpha=ALPHA), seed=7, base=str(hf_dir)))
    policy.load_hf_weights(HFWeights(hf_dir))  # the frozen base
    return policy


def _hf_logprobs(weights, hf_config, batch):
    """Log-probs of ``batch`` by a plain transformers model holding ``weights``, in the engines' alignment."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]


def _stage(hf_dir, run_dir, stage):
    from test_engine_deepspeed import _loss_fn
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import DeepSpeedConfig
    from grpo_mega.engine import build_reference_engine
    from grpo_mega.engine.source_weights import deepspeed_checkpoint_weights
    from grpo_mega.lora import AdaptersOffReference

    hf_config = AutoConfig.from_pretrained(hf_dir)
    batches = [_batch(8, seed) for seed in range(3)]
    out = {}
    base_engine = build_reference_engine(hf_config, max_tokens_per_micro_batch=40, engine_kind="deepspeed",
                                         deepspeed=DeepSpeedConfig(zero_stage=stage, gather_bucket_mb=1))
    base_engine.load_hf_weights(HFWeights(hf_dir))
    base_logprobs = base_engine.forward_logprobs(batches[2])[0]

    policy = _policy(hf_config, hf_dir, stage)
    reference = AdaptersOffReference(policy)
    out["trainable"] = policy.lora.trainable_parameters()
    out["frozen"] = [name for name, p in policy.module.named_parameters() if p.requires_grad != ("lora_" in name)]
    out["step0_diff"] = (policy.forward_logprobs(batches[2])[0] - base_logprobs).abs().max().item()  # B = 0
    before = {name: tensor.clone() for name, tensor in policy.export_hf_weights()}

    def step(engine, index):
        metrics = engine.train_step(batches[index], _loss_fn())
        engine.lr_schedule_step()
        return metrics

    step(policy, 0)
    held = torch.tensor([float(sum(state["exp_avg"].numel() for state in policy.optimizer.state.values()))])
    torch.distributed.all_reduce(held)  # Adam's moments: ZeRO partitions of the trained parameters, over all ranks
    out["optimizer_params"] = int(held.item())
    from grpo_mega.perf.parameters import parameter_figures

    out["figures"] = parameter_figures(policy)  # what the trainer logs with its first update
    out["base_params"] = sum(HFWeights(hf_dir)[name].numel() for name in HFWeights(hf_dir))
    out["base_tensors"] = len(HFWeights(hf_dir))
    merged = {name: tensor.clone() for name, tensor in policy.export_hf_weights()}
    out["names"] = (sorted(merged), sorted(before))
    out["changed"] = sorted(name for name in merged if not torch.equal(merged[name], before[name]))
    out["reference_diff"] = (reference.forward_logprobs(batches[2])[0] - base_logprobs).abs().max().item()
    policy_logprobs = policy.forward_logprobs(batches[2])[0]
    out["policy_moved"] = (policy_logprobs - base_logprobs).abs().max().item()
    real = batches[2]["attention_mask"][:, 1:].bool()
    out["merged_diff"] = (_hf_logprobs(merged, hf_config, batches[2]) - policy_logprobs[:, 1:])[real].abs().max().item()

    checkpoints = CheckpointManager(run_dir, keep_last=1)
    saved = checkpoints.save(policy, 1, extra_state={"position": 1}, config={"engine": "deepspeed"})
    out["saved_bytes"] = sum(path.stat().st_size for path in saved.rglob("*") if path.is_file())
    out["base_bytes"] = sum(path.stat().st_size for path in hf_dir.glob("*.safetensors"))
    module_state = torch.load(next(saved.rglob("*model_states.pt")), weights_only=False)["module"]
    out["saved_module_keys"] = sorted(module_state)
    expected = step(policy, 1)
    expected_weights = dict(policy.export_hf_weights())

    resumed = _policy(hf_config, hf_dir, stage)
    checkpoints.load(resumed, saved, seed=7)
    again = step(resumed, 1)
    keys = [key for key in expected if key != "step_seconds"]
    out["metrics"] = ({key: expected[key] for key in keys}, {key: again[key] for key in keys})
    out["resume_equal"] = all(torch.equal(tensor, expected_weights[name]) for name, tensor in resumed.export_hf_weights())
    try:  # adapters of another rank: refused by name, not loaded halfway (DeepSpeed loads them non-strictly)
        checkpoints.load(_policy(hf_config, hf_dir, stage, rank=2), saved, seed=7)
        out["rank_error"] = None
    except ValueError as error:
        out["rank_error"] = str(error)
    out["checkpoint"], out["batch"], out["merged_logprobs"] = str(saved), batches[2], policy_logprobs
    whole = deepspeed_checkpoint_weights(saved)  # the checkpoint as whole weights: base + merged adapters
    out["init_from_diff"] = max((whole[name] - merged[name]).abs().max().item() for name in merged)
    return out


def _both(hf_dir, run_dir):
    from pathlib import Path

    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=7, device="cpu")
    zero2 = _stage(Path(hf_dir), f"{run_dir}/zero2", 2)
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=7)
    return {2: zero2, 3: _stage(Path(hf_dir), f"{run_dir}/zero3", 3)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path_factory.mktemp("hf")
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(tiny_qwen2_config(tied=False, vocab_size=VOCAB)).save_pretrained(hf_dir)
    return hf_dir, run_distributed(_both, 2, str(hf_dir), str(tmp_path_factory.mktemp("runs")))


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_on_deepspeed_trains_adapters_only_merges_and_resumes_bit_equal(ranks, stage):
    _, ranks = ranks
    out = ranks[0][stage]
    # 4 layers x (q, k, v, o, gate, up, down): A (r x in) + B (out x r); hidden 64, kv 32, intermediate 128
    per_layer = RANK * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert out["trainable"] == 4 * per_layer and out["frozen"] == []  # the base frozen, every adapter trained
    assert out["trainable"] <= out["optimizer_params"] < out["trainable"] + 64  # ZeRO pads its partitions
    assert out["step0_diff"] == 0.0  # B = 0: the adapted model is the base
    # the logged figures: the whole model counted; the bytes one of the 2 ranks holds (fp32 on the CPU): every weight
    # at ZeRO-2, its half of each at ZeRO-3; half the adapters' gradient; its partition's fp32 master copy and Adam's
    # two moments (ZeRO pads partitions; torch's AdamW keeps a 4-byte step per tensor); ZeRO-3 in fp32 makes no
    # master copy (its partition of the fp32 weights is the master: deepspeed/runtime/zero/stage3.py
    # _create_fp32_partitions)
    figures, trainable, total = out["figures"], out["trainable"], out["base_params"] + out["trainable"]
    assert figures["model/trainable_parameters"] == trainable and figures["model/total_parameters"] == total
    tensors = out["base_tensors"] + 4 * 14  # 4 layers x 7 linears x (A, B)
    held = total * 4 if stage == 2 else total * 2  # ZeRO-3: ceil(numel / 2) per tensor
    assert held <= figures["memory/parameter_bytes"] <= held + 4 * tensors
    assert figures["memory/gradient_bytes"] == 4 * ((trainable + 1) // 2)
    copies = 3 if stage == 2 else 2
    state = figures["memory/optimizer_state_bytes"]
    assert 4 * copies * trainable / 2 <= state <= 4 * copies * (trainable / 2 + 64) + 4 * tensors
    merged_names, base_names = out["names"]
    assert merged_names == base_names and not any("lora" in name or "base_layer" in name for name in merged_names)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert out["changed"] and all(name.endswith(tuple(f"{t}.weight" for t in targets)) for name in out["changed"])
    assert len(out["changed"]) == 4 * len(targets)  # every adapted weight moved, nothing else (norms, embeddings)
    assert out["reference_diff"] == 0.0 < out["policy_moved"]
    assert out["merged_diff"] < 5e-5
    assert out["saved_module_keys"] and all(".lora_" in key for key in out["saved_module_keys"])
    assert out["saved_bytes"] < out["base_bytes"] / 1.5  # adapters and their Adam moments, not the model
    expected, again = out["metrics"]
    assert "grad_norm" in expected and again == expected
    assert all(rank[stage]["resume_equal"] for rank in ranks)
    assert "holds LoRA rank=4" in out["rank_error"] and "this job has LoRA rank=2" in out["rank_error"]
    assert out["init_from_diff"] < 1e-6


def test_a_deepspeed_lora_checkpoint_exports_as_a_peft_adapter(ranks, tmp_path):
    """``tools/convert_mcore_to_hf.py --peft-adapter`` of a DeepSpeed LoRA checkpoint: peft loads it onto the base
    and gives the trained policy's log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_mega.engine.deepspeed_checkpoint import export_deepspeed_lora_adapter

    hf_dir, ranks = ranks
    out = ranks[0][2]
    files = export_deepspeed_lora_adapter(out["checkpoint"], tmp_path / "adapter")
    assert sorted(path.name for path in files) == ["adapter_config.json", "adapter_model.safetensors"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                      tmp_path / "adapter")
    batch = out["batch"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    real = batch["attention_mask"][:, 1:].bool()
    assert (logprobs - out["merged_logprobs"][:, 1:])[real].abs().max().item() < 5e-5


def test_config_accepts_lora_on_deepspeed_for_grpo_only():
    from grpo_mega.config import ConfigError, GRPOConfig
    from grpo_mega.config.checks import validate_lora
    from prm.config import PRMConfig

    grpo, prm = GRPOConfig(), PRMConfig()
    for cfg in (grpo, prm):
        cfg.model.hf_config, cfg.model.init_from, cfg.model.lora.rank, cfg.engine = "/x", "/x", 8, "deepspeed"
    validate_lora(grpo)
    with pytest.raises(ConfigError, match="prm train with LoRA needs engine=megatron"):
        validate_lora(prm)
