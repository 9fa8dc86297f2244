"""Checkpoints move between the Transformer Engine and the local layer specs (issue 29, defect 4).

TE's modules carry `_extra_state` (quantization metadata) that megatron's local modules do not, e.g.
``decoder.final_layernorm._extra_state`` (TENorm: megatron's final norm whenever TE imports). TE needs a GPU, so a "TE-like" spec stands in: megatron's block
spec of the local layers whose final norm has a module extra state (get_extra_state / set_extra_state), which
megatron's default sharded state dict turns into the same kind of `_extra_state` object as TE's. Everything else
is the real path: megatron dist_checkpointing (torch_dist) at TP=2 through `save_mcore_checkpoint` /
`load_mcore_checkpoint`, training checkpoints (`CheckpointManager` resume, `load_model_only`) on real engines,
and torch's `load_state_dict`.

Also: the layer spec is chosen by megatron's own Transformer Engine check, with a log line saying why.
"""

from __future__ import annotations

import logging

import pytest
import torch
from dist_utils import run_distributed, tiny_qwen2_config

SEED = 5
LAYERS = 2
EXTRA_KEY = "decoder.final_layernorm._extra_state"


class NormWithExtraState(torch.nn.RMSNorm):
    """RMSNorm with a module extra state, like Transformer Engine's (TENorm's ``te.pytorch.RMSNorm`` keeps its
    quantization metadata there). Built like megatron's norms: ``(config, hidden_size, eps)``."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.extra = torch.tensor([1.0])
        self.received = None

    def get_extra_state(self):
        return self.extra.clone()

    def set_extra_state(self, state):
        self.received = state


class NormWithBuffer(torch.nn.RMSNorm):
    """RMSNorm with a real persistent tensor the checkpoints do not have: its absence must still fail."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.register_buffer("scale", torch.ones(2))


def _spec(final_norm=None):
    """The local layer spec; with ``final_norm``, megatron's block spec around it with that final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from grpo_mega.model.attention import use_sdpa_core_attention

    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    use_sdpa_core_attention(layer)
    if final_norm is None:
        return layer
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * LAYERS, layer_norm=final_norm))


def _build(seed, final_norm=None):
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf

    torch.manual_seed(seed)
    config = gpt_config_from_hf(tiny_qwen2_config(tied=False, num_layers=LAYERS), tp=2, pp=1, dtype=torch.float32)
    return build_gpt_model(config, layer_spec=_spec(final_norm))


def _weights(model):
    from grpo_mega.model.gpt import is_extra_state

    return {k: v.detach().clone() for k, v in model.state_dict().items() if not is_extra_state(k)}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _received(model):
    received = model.decoder.final_layernorm.received
    return None if received is None else float(received[0])


def _mcore_job(tmp: str) -> dict:
    import torch.distributed as dist

    from grpo_mega.checkpoint import load_mcore_checkpoint, save_mcore_checkpoint
    from grpo_mega.parallel import init_distributed

    init_distributed(2, 1, seed=SEED, device="cpu")
    hf_dir, local_dir, te_dir = f"{tmp}/hf", f"{tmp}/local", f"{tmp}/te"
    if dist.get_rank() == 0:
        tiny_qwen2_config(tied=False, num_layers=LAYERS).save_pretrained(hf_dir)
    dist.barrier()
    result = {}

    local = _build(1)
    result["local_has_extra_key"] = EXTRA_KEY in local.sharded_state_dict()
    save_mcore_checkpoint(local, local_dir, hf_dir)
    te_like = _build(2, NormWithExtraState)
    result["te_has_extra_key"] = EXTRA_KEY in te_like.sharded_state_dict()
    load_mcore_checkpoint(te_like, local_dir)  # the checkpoint has no final_layernorm._extra_state
    result["local_into_te"] = _same(_weights(te_like), _weights(local))
    result["local_into_te_received"] = _received(te_like)  # nothing to set: the module keeps its own

    writer = _build(3, NormWithExtraState)
    writer.decoder.final_layernorm.extra += 40.0
    save_mcore_checkpoint(writer, te_dir, hf_dir)
    local2 = _build(4)
    load_mcore_checkpoint(local2, te_dir)  # the checkpoint's final_layernorm._extra_state is not the model's
    result["te_into_local"] = _same(_weights(local2), _weights(writer))
    te_like2 = _build(5, NormWithExtraState)
    load_mcore_checkpoint(te_like2, te_dir)
    result["te_into_te_received"] = _received(te_like2)  # present in the checkpoint: loaded as before

    try:
        load_mcore_checkpoint(_build(6, NormWithBuffer), local_dir)
        result["buffer_error"] = None
    except ValueError as error:
        result["buffer_error"] = str(error)

    # Plain state dicts (torch's load_state_dict, strict): `_extra_state` mismatches either way, nothing else.
    source = _build(7)
    te_like.load_state_dict(source.state_dict())  # lacks the norm's _extra_state
    result["plain_local_into_te"] = _same(_weights(te_like), _weights(source))
    local.load_state_dict(writer.state_dict())  # carries an _extra_state the local norm does not have
    result["plain_te_into_local"] = _same(_weights(local), _weights(writer))
    plain_errors = []
    for state in ({k: v for k, v in local.state_dict().items() if k != "decoder.final_layernorm.weight"},
                  {**local.state_dict(), "decoder.layers.0.mlp.linear_fc1.bogus": torch.zeros(1)}):
        try:
            _build(8).load_state_dict(state)
            plain_errors.append(None)
        except RuntimeError as error:
            plain_errors.append(str(error))
    result["plain_errors"] = plain_errors
    return result


@pytest.fixture(scope="module")
def mcore_runs(tmp_path_factory):
    return run_distributed(_mcore_job, 2, str(tmp_path_factory.mktemp("extra_state")))


def test_only_the_te_like_model_has_the_extra_state_object(mcore_runs):
    for rank in mcore_runs:
        assert rank["te_has_extra_key"] and not rank["local_has_extra_key"]


def test_local_checkpoint_loads_into_layers_that_expect_extra_state(mcore_runs):
    for rank in mcore_runs:
        assert rank["local_into_te"]
        assert rank["local_into_te_received"] is None


def test_te_checkpoint_loads_into_local_layers_and_keeps_its_extra_state_for_te(mcore_runs):
    for rank in mcore_runs:
        assert rank["te_into_local"]
        assert rank["te_into_te_received"] == 41.0  # as written


def test_any_other_missing_tensor_still_fails_loudly(mcore_runs):
    for rank in mcore_runs:
        assert rank["buffer_error"] is not None
        assert "decoder.final_layernorm.scale" in rank["buffer_error"] and "/local" in rank["buffer_error"]


def test_plain_state_dicts_ignore_extra_state_mismatches_only(mcore_runs):
    for rank in mcore_runs:
        assert rank["plain_local_into_te"] and rank["plain_te_into_local"]
        missing, unexpected = rank["plain_errors"]
        assert missing is not None and "decoder.final_layernorm.weight" in missing
        assert unexpected is not None and "linear_fc1.bogus" in unexpected


def _engine_weights(engine):
    return _weights(engine.stage)


def _training_job(tmp: str) -> dict:
    import grpo_mega.model.gpt as gpt
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.checkpoint.weights_only import load_model_only
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED, device="cpu")
    local_spec = gpt.transformer_layer_spec

    def engine(te_like: bool):
        # The spec a machine with Transformer Engine would pick, swapped in where build_gpt_model asks for it.
        gpt.transformer_layer_spec = (lambda config: _spec(NormWithExtraState)) if te_like else local_spec
        try:
            return build_policy_engine(tiny_qwen2_config(tied=False, num_layers=LAYERS), optim=OptimConfig(lr=1e-3),
                                       total_steps=2, max_tokens_per_micro_batch=40)
        finally:
            gpt.transformer_layer_spec = local_spec

    config = {"parallel": {"tensor": 1, "pipeline": 1}}
    result = {}
    for saved_by, loaded_by in (("local", "te"), ("te", "local")):
        writer = engine(saved_by == "te")
        run_dir = f"{tmp}/{saved_by}"
        manager = CheckpointManager(run_dir)
        manager.save(writer, 1, extra_state={"prompts_consumed": 3}, config=config)
        resumed = engine(loaded_by == "te")
        differs_before = not _same(_engine_weights(resumed), _engine_weights(writer))
        loaded = manager.load(resumed, manager.find_resume("auto"), seed=SEED)
        fresh = engine(loaded_by == "te")
        load_model_only(fresh, run_dir)
        result[f"{saved_by}->{loaded_by}"] = {
            "differs_before": differs_before, "step": loaded.step,
            "resumed": _same(_engine_weights(resumed), _engine_weights(writer)),
            "model_only": _same(_engine_weights(fresh), _engine_weights(writer)),
        }
    return result


def test_training_checkpoints_resume_across_layer_specs(tmp_path):
    result = run_distributed(_training_job, 1, str(tmp_path))[0]
    for direction in ("local->te", "te->local"):
        run = result[direction]
        assert run["differs_before"] and run["step"] == 1, direction
        assert run["resumed"] and run["model_only"], direction
