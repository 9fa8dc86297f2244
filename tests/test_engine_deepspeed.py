"""The DeepSpeed ZeRO engine (``engine: deepspeed``): one GRPO step equals the Megatron engine's from the same
weights; ZeRO-3 trains, resumes exactly through the trainer's checkpoints and exports an HF folder that transformers
loads with the engine's log-probs; a non-finite step changes nothing; bad configs fail naming the field.

One spawn of 2 gloo processes (DeepSpeed's CPU accelerator; module fixture ``ranks``) runs the ZeRO-2 and the ZeRO-3
work in turn: each process pays its interpreter start-up (torch, megatron, deepspeed, transformers) once."""

import importlib.util
import math

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

pytest.importorskip("deepspeed")

VOCAB = 301


def _batch(rows=6, seed=0, vocab=VOCAB):
    """Rows of different lengths (3 prompt tokens each), GRPO fields as the update stage builds them."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 7, 9, 5, 12, 10, 8, 11][:rows])
    input_ids = torch.randint(0, vocab, (rows, 12), generator=generator)
    attention_mask = (torch.arange(12) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, 12).contiguous()
    old_logprobs = -torch.rand(rows, 12, generator=generator) * 6 - 2
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                advantages=advantages, old_logprobs=old_logprobs)


def _optim():
    from grpo_mega.config import OptimConfig

    # eps 1e-4: Adam's first step is lr * g / (|g| + eps); a tiny eps turns reduction-order noise into update.
    return OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_eps=1e-4, decay_style="cosine")


def _loss_fn():
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    return grpo_loss_fn(GRPOLossSettings(clip_high=0.28, kl_coef=0.0, loss_agg_mode="seq-mean-token-mean"))


def _deepspeed_policy(hf_config, stage, budget):
    from grpo_mega.config import DeepSpeedConfig
    from grpo_mega.engine import build_policy_engine

    return build_policy_engine(hf_config, optim=_optim(), total_steps=4, max_tokens_per_micro_batch=budget,
                               engine_kind="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=stage, gather_bucket_mb=1))


def _weights(engine):
    return {name: tensor.clone() for name, tensor in engine.export_hf_weights()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An untied tiny Qwen2 with seeded weights, saved as an HF folder."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(tiny_qwen2_config(tied=False, vocab_size=VOCAB)).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- ZeRO-2 == Megatron
def _zero2_and_megatron_step(hf_dir):
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import DeepSpeedConfig
    from grpo_mega.engine import build_policy_engine, build_reference_engine
    from grpo_mega.engine.base import NonFiniteError

    hf_config = AutoConfig.from_pretrained(hf_dir)
    megatron = build_policy_engine(hf_config, optim=_optim(), total_steps=4, max_tokens_per_micro_batch=24)
    megatron.load_hf_weights(HFWeights(hf_dir))
    # budget 20 on the DeepSpeed side: other micro-batches than Megatron's 24, and unequal counts per rank
    deepspeed = _deepspeed_policy(hf_config, 2, 20)
    deepspeed.load_hf_weights(HFWeights(hf_dir))
    reference = build_reference_engine(hf_config, max_tokens_per_micro_batch=20, engine_kind="deepspeed",
                                       deepspeed=DeepSpeedConfig(zero_stage=2))  # a replicated forward-only model
    reference.load_hf_weights(HFWeights(hf_dir))
    start = _weights(deepspeed)
    out = {"logprobs": [e.forward_logprobs(_batch())[0] for e in (megatron, deepspeed, reference)]}
    out["metrics"] = [e.train_step(_batch(), _loss_fn()) for e in (megatron, deepspeed)]
    out["weights"] = [_weights(megatron), _weights(deepspeed)]
    from grpo_mega.perf.parameters import parameter_figures

    out["figures"] = parameter_figures(deepspeed)  # full training at ZeRO-2 (LoRA's: test_deepspeed_lora)
    out["moved"] = max((out["weights"][1][k] - start[k]).abs().max().item() for k in start)

    # A NaN loss on one rank's micro-batch: NonFiniteError on every rank, nothing applied, and training goes on.
    def poisoned(outputs, micro, scale):
        loss, metrics = _loss_fn()(outputs, micro, scale)
        return (loss * math.nan if bool((micro["row_index"] == 0).any()) else loss), metrics

    before = _weights(deepspeed)
    try:
        deepspeed.train_step(_batch(), poisoned)
        out["raised"] = None
    except NonFiniteError as error:
        out["raised"] = (error.loss, error.grad_norm)
    out["unchanged"] = max((_weights(deepspeed)[k] - before[k]).abs().max().item() for k in before)
    out["steps_done"] = deepspeed.steps_done
    out["after"] = deepspeed.train_step(_batch(seed=1), _loss_fn())
    one_row = {name: value[:1] for name, value in _batch().items()}  # fewer rows than ranks
    out["one_row"] = (deepspeed.forward_logprobs(one_row)[0], deepspeed.forward_logprobs(_batch())[0][:1])
    return out


def test_zero2_step_equals_megatron_step(ranks):
    for rank in (r["zero2"] for r in ranks):
        megatron, deepspeed = rank["metrics"]
        real = _batch()["attention_mask"].bool()  # padding positions hold whatever their micro-batch computed
        torch.testing.assert_close(rank["logprobs"][1][real], rank["logprobs"][0][real], atol=1e-4, rtol=0)
        torch.testing.assert_close(rank["logprobs"][2], rank["logprobs"][1], atol=1e-6, rtol=0)
        assert deepspeed["loss"] == pytest.approx(megatron["loss"], abs=1e-4)
        assert deepspeed["grad_norm"] == pytest.approx(megatron["grad_norm"], rel=1e-4)
        assert deepspeed["grad_norm"] > 0.5  # clipping was active (clip_grad 0.5)
        assert deepspeed["actor/pg_clipfrac"] == pytest.approx(megatron["actor/pg_clipfrac"], abs=1e-6)
        assert deepspeed["lr"] == megatron["lr"] == 1e-2
        assert rank["moved"] > 1e-3  # the step really changed the weights
        assert rank["weights"][0].keys() == rank["weights"][1].keys()
        for name, value in rank["weights"][0].items():
            torch.testing.assert_close(rank["weights"][1][name], value, atol=1e-4, rtol=0, msg=name)
        loss, grad_norm = rank["raised"]
        assert math.isnan(loss) and not math.isfinite(grad_norm)
        assert rank["unchanged"] == 0.0 and rank["steps_done"] == 1
        assert math.isfinite(rank["after"]["loss"]) and rank["after"]["grad_norm"] > 0
        alone, in_batch = rank["one_row"]
        torch.testing.assert_close(alone[real[:1]], in_batch[real[:1]], atol=1e-5, rtol=0)


def test_zero2_logs_the_parameter_figures_of_what_each_rank_holds(ranks):
    """Full training at ZeRO-2 on 2 ranks (fp32 on the CPU): every weight trained; each rank holds every weight,
    half the gradient, and its half of the fp32 master copy and Adam's two moments (ZeRO pads its partition;
    torch's AdamW keeps a 4-byte step per tensor)."""
    for rank in (r["zero2"] for r in ranks):
        figures, weights = rank["figures"], rank["weights"][1]
        total = sum(value.numel() for value in weights.values())  # untied: the HF model's every tensor
        assert figures["model/trainable_parameters"] == figures["model/total_parameters"] == total
        assert figures["memory/parameter_bytes"] == 4 * total
        assert figures["memory/gradient_bytes"] == 4 * ((total + 1) // 2)
        state = figures["memory/optimizer_state_bytes"]
        assert 12 * total / 2 <= state <= 12 * (total / 2 + 64) + 4 * len(weights)


# ----------------------------------------------------------------------------- ZeRO-3: resume, export
def _count_gathers():
    """Wrap torch.distributed's all-gathers with a call counter; returns the counter list."""
    import torch.distributed as dist

    calls = []
    for name in ("all_gather_into_tensor", "all_gather", "_all_gather_base"):
        original = getattr(dist, name, None)
        if original is not None:
            def counted(*args, _original=original, **kwargs):
                calls.append(1)
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
    return calls


def _zero3_train_resume_export(model_dir, run_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.checkpoint.weights_only import load_model_only
    from grpo_mega.config import DeepSpeedConfig
    from grpo_mega.engine import build_reference_engine
    from grpo_mega.engine.deepspeed_checkpoint import save_hf_checkpoint

    hf_config = AutoConfig.from_pretrained(model_dir)
    vocab = hf_config.vocab_size
    batches = [_batch(rows=8, seed=s, vocab=vocab) for s in range(3)]
    checkpoints = CheckpointManager(run_dir, keep_last=1)

    def step(engine, index):
        metrics = engine.train_step(batches[index], _loss_fn())
        engine.lr_schedule_step()
        return metrics

    uninterrupted = _deepspeed_policy(hf_config, 3, 40)
    for index in range(2):
        step(uninterrupted, index)
    saved = checkpoints.save(uninterrupted, 2, extra_state={"position": 2}, config={"engine": "deepspeed"})
    saved_weights = _weights(uninterrupted)
    expected = step(uninterrupted, 2)
    expected_weights = _weights(uninterrupted)

    resumed = _deepspeed_policy(hf_config, 3, 40)
    loaded = checkpoints.load(resumed, saved, seed=7)
    out = {"extra_state": loaded.extra_state, "steps_done": resumed.steps_done, "lr": resumed.current_lr,
           "expected_lr": expected["lr"]}
    out["metrics"] = (expected, step(resumed, 2))
    calls = _count_gathers()
    weights = _weights(resumed)
    out["gathers"], out["tensors"] = len(calls), len(weights)
    out["weight_diff"] = max((weights[k] - expected_weights[k]).abs().max().item() for k in weights)
    out["names"] = sorted(weights)

    hf_out = save_hf_checkpoint(resumed, f"{run_dir}/hf", side_files_from=model_dir)
    batch = batches[0]
    logprobs, _ = resumed.forward_logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"]).logits
    hf_logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    real = batch["attention_mask"][:, 1:].bool()
    out["export_diff"] = (hf_logprobs - logprobs[:, 1:])[real].abs().max().item()
    out["export_names"] = sorted(hf.state_dict())

    # model.init_from a DeepSpeed checkpoint: its merged weights written into a fresh engine's ZeRO-3 partitions,
    # and the fp32 master partitions follow them (a fresh Adam step moves no weight by more than lr = 0.01).
    fresh = _deepspeed_policy(hf_config, 3, 40)
    load_model_only(fresh, saved)
    loaded_weights = _weights(fresh)
    reference = build_reference_engine(hf_config, max_tokens_per_micro_batch=40, engine_kind="deepspeed",
                                       deepspeed=DeepSpeedConfig(zero_stage=3, gather_bucket_mb=1))
    load_model_only(reference, saved)  # forward-only ZeRO-3: partitioned, no optimizer
    reference_logprobs, fresh_logprobs = (e.forward_logprobs(batches[2])[0] for e in (reference, fresh))
    out["reference_diff"] = (reference_logprobs - fresh_logprobs).abs().max().item()
    out["init_from_diff"] = max((loaded_weights[k] - saved_weights[k]).abs().max().item() for k in saved_weights)
    fresh.train_step(batches[2], _loss_fn())
    out["init_from_step"] = max((w - saved_weights[k]).abs().max().item() for k, w in fresh.export_hf_weights())

    # ZeRO partitions belong to one stage and process count: a ZeRO-2 job cannot resume them, and says so.
    try:
        checkpoints.load(_deepspeed_policy(hf_config, 2, 40), saved, seed=7)
        out["stage_error"] = None
    except ValueError as error:
        out["stage_error"] = str(error)
    return out


def _both(hf_dir, model_dir, run_dir):
    """The ZeRO-2 comparison, then (megatron's groups rebuilt and reseeded) the ZeRO-3 run; this order because the
    latter wraps torch.distributed's all-gathers with a counter for the rest of the process."""
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=7, device="cpu")
    zero2 = _zero2_and_megatron_step(hf_dir)
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=7)
    return {"zero2": zero2, "zero3": _zero3_train_resume_export(model_dir, run_dir)}


@pytest.fixture(scope="module")
def ranks(hf_dir, tmp_path_factory):
    """Both parts' results, by rank."""
    from tiny_task import build_tiny_task

    root = tmp_path_factory.mktemp("zero3")
    model_dir, _ = build_tiny_task(root / "task")
    return run_distributed(_both, 2, str(hf_dir), str(model_dir), str(root / "run"))


def test_zero3_resumes_exactly_and_exports_hf(ranks):
    for rank in (r["zero3"] for r in ranks):
        expected, resumed = rank["metrics"]
        assert rank["extra_state"] == {"position": 2} and rank["steps_done"] == 2
        assert rank["lr"] == rank["expected_lr"]
        assert resumed["loss"] == expected["loss"] and resumed["grad_norm"] == expected["grad_norm"]
        assert rank["weight_diff"] == 0.0
        # bucketed ZeRO-3 gathers: fewer collectives than tensors (1 MiB buckets of a ~3 MiB model)
        assert 1 <= rank["gathers"] < rank["tensors"] / 4
        assert "lm_head.weight" not in rank["names"]  # tied: the embedding only, as the HF checkpoint stores it
        assert rank["export_diff"] < 1e-4
        assert "model.embed_tokens.weight" in rank["export_names"]
        assert rank["init_from_diff"] < 1e-6
        assert rank["reference_diff"] < 1e-6
        assert 1e-4 < rank["init_from_step"] < 0.015
        assert "ZeRO-3" in rank["stage_error"] and "deepspeed.zero_stage=3" in rank["stage_error"]


def test_forward_only_engine_casts_parameters_not_buffers():
    """On a GPU the replicated forward-only engine (the KL reference at ZeRO-1/2) holds bf16 parameters; its rotary
    ``inv_freq`` stays fp32 as in the DeepSpeed training engine, so both compute the same rotary angles."""
    from transformers import AutoModelForCausalLM

    from grpo_mega.engine.deepspeed_setup import cast_parameters

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(tied=False, vocab_size=VOCAB))
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    cast_parameters(model, torch.device("cpu"), torch.bfloat16)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)  # bf16 would round it: 1/10000^(k/8)


# ----------------------------------------------------------------------------- configuration errors
def _config(*overrides):
    from grpo_mega.config import GRPOConfig, load_config, validate

    required = ["model.hf_config=x", "data.train_file=y"]
    return load_config(GRPOConfig, None, [*required, *overrides], validate)


def test_engine_field_is_validated():
    from grpo_mega.config import ConfigError

    assert _config().engine == "megatron"
    cfg = _config("engine=deepspeed", "deepspeed.zero_stage=3")
    assert (cfg.engine, cfg.deepspeed.zero_stage, cfg.deepspeed.offload_optimizer) == ("deepspeed", 3, False)
    with pytest.raises(ConfigError, match=r"engine='fsdp': expected one of \('megatron', 'deepspeed'\)"):
        _config("engine=fsdp")
    with pytest.raises(ConfigError, match=r"deepspeed.zero_stage=4: expected one of \(1, 2, 3\)"):
        _config("engine=deepspeed", "deepspeed.zero_stage=4")
    with pytest.raises(ConfigError, match="engine=deepspeed .* parallel.tensor=1 and parallel.pipeline=1"):
        _config("engine=deepspeed", "parallel.tensor=2")
    _config("parallel.tensor=2")  # the Megatron engine keeps its layouts


def test_missing_deepspeed_is_a_clear_error(monkeypatch):
    import sys

    from grpo_mega.config import ConfigError
    from grpo_mega.engine.deepspeed_setup import import_deepspeed

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"engine=deepspeed needs the deepspeed package.*grpo-mega\[deepspeed\]"):
        _config("engine=deepspeed")
    _config()  # the Megatron engine does not need it
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'grpo-mega\[deepspeed\]'"):
        import_deepspeed(torch.device("cpu"))


def test_factory_rejects_an_unknown_engine():
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    with pytest.raises(ValueError, match="engine='fsdp': expected 'megatron' or 'deepspeed'"):
        build_policy_engine(tiny_qwen2_config(tied=True), optim=OptimConfig(), total_steps=1,
                            max_tokens_per_micro_batch=8, engine_kind="fsdp")
