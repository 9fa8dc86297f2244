"""Sequence parallelism and activation recompute (``parallel.sequence_parallel``, ``parallel.recompute``).

Through the Megatron engine on 2 gloo processes at TP=2: a training step with sequence parallelism equals the same
step without it (log-probs, entropies, loss, gradient norm, updated parameters), on the row path and on the packed
shared-prompt path, with sequence lengths that are not multiples of TP (the padding is invisible); selective and
full recompute equal no recompute; the KL reference's forward and a classifier PRM's step (a replicated head on the
gathered hidden states) are unchanged by sequence parallelism. On one process, full recompute lowers the measured
activation peak of an update of a ~25M-parameter model.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dist_utils import run_distributed, tiny_qwen2_config
from grpo_mega.config import ConfigError, GRPOConfig, RECOMPUTE_CHOICES, validate_memory_settings
from grpo_mega.data.batch import sequences_to_batch
from grpo_mega.model.config_map import RECOMPUTE_SETTINGS

VOCAB = 301
# name -> (sequence_parallel, recompute); the first is the reference every other one must equal
SETTINGS = {
    "plain": (False, "none"),
    "sp": (True, "none"),
    "sp_selective": (True, "selective"),
    "sp_full": (True, "full"),
}
BUDGET = 30  # several micro-batches, of odd and even lengths


def _grouped_batch(groups=4, group_size=3, seed=0):
    """``groups`` prompts of 2-8 tokens with ``group_size`` responses of 1-11 tokens each, GRPO fields set."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        count = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(0, VOCAB, (count,), generator=generator).tolist()

    prompts, responses = [], []
    for _ in range(groups):
        prompt = tokens(2, 9)
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append(tokens(1, 12))
    batch = sequences_to_batch(prompts, responses, pad_id=0)
    rows, width = batch["input_ids"].shape
    batch["advantages"] = torch.randn(rows, 1, generator=generator).expand(rows, width) * batch["loss_mask"]
    batch["old_logprobs"] = -torch.rand(rows, width, generator=generator) * 4 * batch["loss_mask"]
    batch["rollout_logprobs"] = batch["old_logprobs"].clone()
    return batch


def _layer_input_lengths(engine, batch):
    """Sequence length of the first layer's input in each micro-batch of a forward pass (this rank's slice)."""
    lengths = []
    hook = engine.stage.decoder.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        engine.forward_logprobs(batch)
    finally:
        hook.remove()
    return lengths


def _policy_step(share, sequence_parallel, recompute, ref_dir, tied=False):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    # adam_eps 1e-4: see tests/test_engine_megatron.py (reduction-order noise in near-zero gradient entries)
    engine = build_policy_engine(tiny_qwen2_config(tied=tied), optim=OptimConfig(lr=1e-2, clip_grad=0.5, adam_eps=1e-4),
                                 total_steps=2, max_tokens_per_micro_batch=BUDGET, share_prompt_prefix=share,
                                 sequence_parallel=sequence_parallel, recompute=recompute)
    engine.load_model_weights(ref_dir)
    batch = _grouped_batch()
    micro_batches = engine._micro_batches(batch)
    logprobs, entropy = engine.forward_logprobs(batch)
    metrics = engine.train_step(batch, grpo_loss_fn(GRPOLossSettings(clip_high=0.28, loss_agg_mode="token-mean")))
    mask = batch["attention_mask"].bool()
    return {
        "logprobs": logprobs[mask], "entropy": entropy[mask], "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "params": {k: v.detach().clone() for k, v in engine.stage.named_parameters()},
        "sequence_parallel": engine.config.sequence_parallel,
        "recompute": (engine.config.recompute_granularity, engine.config.recompute_method,
                      engine.config.recompute_num_layers),
        "packed": [("packed_source" in m) for m in micro_batches],
        # tokens each micro-batch puts through the layers, and the first layer's input length on this rank
        "layer_lengths": [len(m["packed_source"]) if "packed_source" in m else m["input_ids"].shape[1]
                          for m in micro_batches],
        "layer_input": _layer_input_lengths(engine, batch),  # collective: every stage runs the forward
    }


def _reference_forward(sequence_parallel, ref_dir):
    from grpo_mega.engine import build_reference_engine

    engine = build_reference_engine(tiny_qwen2_config(tied=False), max_tokens_per_micro_batch=BUDGET,
                                    share_prompt_prefix=True, sequence_parallel=sequence_parallel)
    engine.load_model_weights(ref_dir)
    batch = _grouped_batch(seed=1)
    logprobs, entropy = engine.forward_logprobs(batch)
    mask = batch["attention_mask"].bool()
    return {"logprobs": logprobs[mask], "entropy": entropy[mask], "sequence_parallel": engine.config.sequence_parallel}


def _prm_config():
    config = tiny_qwen2_config(tied=False)
    config.architectures = ["Qwen2ForProcessRewardModel"]
    return config


def _prm_step(sequence_parallel, prm_dir):
    from grpo_mega.config import OptimConfig
    from prm.engines import build_prm_engine
    from prm.spec import PRMSpec
    from prm.train import prm_loss

    engine = build_prm_engine(_prm_config(), PRMSpec("classifier", "<tag>"), None,
                              optim=OptimConfig(lr=1e-2, adam_eps=1e-4), total_steps=2,
                              max_tokens_per_micro_batch=BUDGET, sequence_parallel=sequence_parallel)
    engine.load_model_weights(prm_dir)
    batch = _grouped_batch(seed=2)
    generator = torch.Generator().manual_seed(5)
    batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
             "loss_mask": batch["loss_mask"] * (torch.rand(batch["loss_mask"].shape, generator=generator) < 0.3),
             "targets": (torch.rand(batch["loss_mask"].shape, generator=generator) < 0.5).float()}
    metrics = engine.train_step(batch, prm_loss)
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "params": {k: v.detach().clone() for k, v in engine.stage.named_parameters()}}


def _job(ref_dir, prm_dir):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from prm.engines import build_prm_engine
    from prm.spec import PRMSpec

    init_distributed(1, 1, seed=3, device="cpu")
    build_policy_engine(tiny_qwen2_config(tied=False), optim=OptimConfig(), total_steps=1,
                        max_tokens_per_micro_batch=1000).save_model_weights(ref_dir)
    build_prm_engine(_prm_config(), PRMSpec("classifier", "<tag>"), None, optim=OptimConfig(), total_steps=1,
                     max_tokens_per_micro_batch=1000).save_model_weights(prm_dir)
    destroy_model_parallel()
    init_model_parallel(2, 1, seed=3)
    out = {}
    for share in (False, True):
        for name, (sequence_parallel, recompute) in SETTINGS.items():
            out[(share, name)] = _policy_step(share, sequence_parallel, recompute, ref_dir)
    out["reference"] = {sp: _reference_forward(sp, ref_dir) for sp in (False, None)}
    out["prm"] = {sp: _prm_step(sp, prm_dir) for sp in (False, True)}
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    return run_distributed(_job, 2, str(root / "ref"), str(root / "prm"))


# Log-probs reach -11 with the tiny model's spread weights, and fp32 rounding grows through its layers: sequence
# parallelism rounds differently (hidden states differ by a few ulp after the first layer), so the bound is 1e-5
# plus 3 ulp-scale relative. Not a loss of exactness: the same comparison in float64 agrees to 3e-14.
LOGPROB_TOLERANCE = dict(atol=1e-5, rtol=3e-6)


def _max_differences(got, want):
    """Largest differences of a step from the plain one (printed with ``pytest -s`` for the record)."""
    return {"logprobs": float((got["logprobs"] - want["logprobs"]).abs().max()),
            "loss": abs(got["loss"] - want["loss"]), "grad_norm_rel": abs(got["grad_norm"] / want["grad_norm"] - 1),
            "params": max(float((got["params"][k] - v).abs().max()) for k, v in want["params"].items())}


def _assert_same_step(got, want):
    print(_max_differences(got, want))
    torch.testing.assert_close(got["logprobs"], want["logprobs"], **LOGPROB_TOLERANCE)
    torch.testing.assert_close(got["entropy"], want["entropy"], **LOGPROB_TOLERANCE)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert want["grad_norm"] > 1e-3
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        torch.testing.assert_close(got["params"][key], value, atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("share", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", [name for name in SETTINGS if name != "plain"])
def test_tp2_step_with_sequence_parallel_and_recompute_equals_plain_step(tp2, share, name):
    sequence_parallel, recompute = SETTINGS[name]
    for rank in tp2:
        plain, got = rank[(share, "plain")], rank[(share, name)]
        assert plain["sequence_parallel"] is False and got["sequence_parallel"] is sequence_parallel
        granularity = RECOMPUTE_SETTINGS[recompute].get("recompute_granularity")
        assert got["recompute"][0] == granularity
        assert all(packed is share for packed in got["packed"])
        _assert_same_step(got, plain)
        # sequence parallelism really split the layers' input: each rank holds half of the padded sequence
        assert plain["layer_input"] == plain["layer_lengths"]
        assert got["layer_input"] == [(length + 1) // 2 for length in got["layer_lengths"]]
        assert any(length % 2 for length in got["layer_lengths"])  # some micro-batch needed padding


def test_reference_forward_with_sequence_parallel_equals_without(tp2):
    for rank in tp2:
        plain, sp = rank["reference"][False], rank["reference"][None]
        # sequence_parallel None (the config's default, null) is on at TP=2
        assert sp["sequence_parallel"] is True and plain["sequence_parallel"] is False
        torch.testing.assert_close(sp["logprobs"], plain["logprobs"], **LOGPROB_TOLERANCE)
        torch.testing.assert_close(sp["entropy"], plain["entropy"], **LOGPROB_TOLERANCE)


def test_prm_step_with_sequence_parallel_equals_without(tp2):
    """The classifier head is replicated over TP: its gradient, and the one it sends back through the gather of
    the sequence-parallel hidden states, must not be summed over the TP ranks."""
    for rank in tp2:
        plain, sp = rank["prm"][False], rank["prm"][True]
        assert sp["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        assert sp["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
        for key, value in plain["params"].items():
            torch.testing.assert_close(sp["params"][key], value, atol=1e-5, rtol=0, msg=key)


def _pipeline_job(ref_dir):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=3, device="cpu")
    build_policy_engine(tiny_qwen2_config(tied=True), optim=OptimConfig(), total_steps=1,
                        max_tokens_per_micro_batch=1000).save_model_weights(ref_dir)
    destroy_model_parallel()
    init_model_parallel(2, 2, seed=3)
    return {(share, name): _policy_step(share, *SETTINGS[name], ref_dir, tied=True)
            for share in (False, True) for name in ("plain", "sp_full")}


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    return run_distributed(_pipeline_job, 4, str(tmp_path_factory.mktemp("sequence_parallel_pp") / "ref"))


@pytest.mark.parametrize("share", [False, True], ids=["rows", "packed"])
def test_tp2_pp2_step_with_sequence_parallel_and_full_recompute_equals_plain_step(tp2_pp2, share):
    """Pipeline stages pass on their slice of the sequence; the last one gathers it (tied embeddings across
    stages)."""
    for rank in tp2_pp2:
        got = rank[(share, "sp_full")]
        _assert_same_step(got, rank[(share, "plain")])
        assert got["sequence_parallel"] is True and got["recompute"][0] == "full"
        assert got["layer_input"] == [(length + 1) // 2 for length in got["layer_lengths"]]


# ----------------------------------------------------------------------------- activation memory
class LiveBytes(TorchDispatchMode):
    """Peak of the bytes held by tensors allocated while the mode is on: a storage counts from the op that
    creates it until it is freed (a weak reference on the storage; autograd's saved tensors keep theirs alive).
    Outputs that alias an input (views, in-place ops) allocate nothing. ``stop()`` freezes the peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.tracked: set[int] = set()
        self.stopped = False

    def _free(self, key: int, nbytes: int) -> None:
        self.tracked.discard(key)
        self.live -= nbytes

    def stop(self) -> None:
        self.stopped = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stopped:
            return out
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self.tracked or key in inputs or storage.nbytes() == 0:
                continue
            self.tracked.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


MODEL_25M = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


def _activation_peaks():
    """Peak live bytes of the forward and backward passes of one update of a ~25M model (the optimizer step,
    whose Adam state is the same for every setting, is left out), per ``parallel.recompute``."""
    from transformers import Qwen2Config

    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=3, device="cpu")
    config = Qwen2Config(**MODEL_25M, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 8192, (32,), generator=generator).tolist()] * 2
    responses = [torch.randint(0, 8192, (224,), generator=generator).tolist() for _ in prompts]
    batch = sequences_to_batch(prompts, responses, pad_id=0)
    batch["advantages"] = torch.tensor([[1.0], [-1.0]]).expand_as(batch["loss_mask"]) * batch["loss_mask"]
    batch["old_logprobs"] = torch.full(batch["loss_mask"].shape, -9.0) * batch["loss_mask"]
    loss_fn = grpo_loss_fn(GRPOLossSettings())
    peaks, weights = {}, None
    for recompute in RECOMPUTE_CHOICES:
        engine = build_policy_engine(config, optim=OptimConfig(lr=1e-5), total_steps=1,
                                     max_tokens_per_micro_batch=4096, share_prompt_prefix=False, recompute=recompute)
        if weights is None:
            weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in engine.stage.state_dict().items()}
        engine.load_model_state_dict(weights)
        params = sum(p.numel() for p in engine.stage.parameters())
        tracker = LiveBytes()
        update = engine._apply_update

        def measured_update(loss, tracker=tracker, update=update):
            tracker.stop()
            return update(loss)

        engine._apply_update = measured_update
        with tracker:
            metrics = engine.train_step(batch, loss_fn)
        peaks[recompute] = {"peak": tracker.peak, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                            "params": params}
        del engine
    return peaks


def test_full_recompute_lowers_the_activation_peak_of_a_25m_update():
    peaks = run_distributed(_activation_peaks, 1)[0]
    none, selective, full = peaks["none"], peaks["selective"], peaks["full"]
    print({name: f"{value['peak'] / 2**20:.1f} MiB" for name, value in peaks.items()}, f"{none['params']:,} params")
    assert 20e6 < none["params"] < 30e6
    for other in (selective, full):  # the same update
        assert other["loss"] == pytest.approx(none["loss"], abs=1e-6)
        assert other["grad_norm"] == pytest.approx(none["grad_norm"], rel=1e-5)
    # 512 tokens through 8 layers: every layer's activations (tens of MiB) against one layer's plus the inputs
    assert full["peak"] < 0.6 * none["peak"]
    assert selective["peak"] <= none["peak"]


# ----------------------------------------------------------------------------- configuration
def _config(**parallel):
    cfg = GRPOConfig()
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def test_recompute_choices_match_the_megatron_settings():
    assert tuple(RECOMPUTE_SETTINGS) == RECOMPUTE_CHOICES
    assert RECOMPUTE_SETTINGS["full"] == dict(recompute_granularity="full", recompute_method="uniform",
                                              recompute_num_layers=1)


def test_memory_settings_are_validated_with_the_key_and_the_fix():
    validate_memory_settings(_config(tensor=2, sequence_parallel=True, recompute="full"))
    validate_memory_settings(_config(tensor=1, sequence_parallel=None))
    validate_memory_settings(_config(tensor=1, sequence_parallel=False))
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel=true .* parallel\.tensor=1: set"):
        validate_memory_settings(_config(tensor=1, sequence_parallel=True))
    with pytest.raises(ConfigError, match=r"parallel\.recompute='partial'"):
        validate_memory_settings(_config(recompute="partial"))
    cfg = _config(recompute="selective")
    cfg.engine = "deepspeed"
    with pytest.raises(ConfigError, match=r"parallel\.recompute='selective' .* engine=deepspeed .* set "
                                          r"parallel\.recompute=none"):
        validate_memory_settings(cfg)


def test_yaml_keys_load_for_grpo_sft_and_prm(tmp_path):
    from grpo_mega.config import SFTConfig, load_config, validate_sft
    from prm.config import PRMConfig, validate_prm

    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  tensor: 2\n  sequence_parallel: false\n  recompute: full\n")
    for schema, validator, required in ((SFTConfig, validate_sft, ["model.hf_config=x", "data.train_file=x"]),
                                        (PRMConfig, validate_prm, ["model.hf_config=x", "data.train_file=x"])):
        cfg = load_config(schema, path, required, validator)
        assert (cfg.parallel.sequence_parallel, cfg.parallel.recompute) == (False, "full")
        assert load_config(schema, None, required).parallel.sequence_parallel is None  # default: auto
        with pytest.raises(ConfigError, match="parallel.recompute"):
            load_config(schema, path, [*required, "parallel.recompute=everything"], validator)
