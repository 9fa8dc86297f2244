"""The policy model across layouts: HF config mapping, vocab-parallel log-probs, TP/PP/DP equality.

One 4-process gloo job (module fixture `job`) builds seeded reference weights at TP=1, then loads
them at TP=2 x DP=2, PP=2 x DP=2, TP=2 x PP=2 and DP=4, and runs the LM head through megatron's
forward-backward schedule at each. The tests below check what it returned.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import (
    load_reference_weights,
    run_distributed,
    save_reference_weights,
    tiny_qwen2_config,
)
from transformers import LlamaConfig, Qwen2Config

from grpo_mega.model import gpt_config_from_hf, padded_vocab_size

SEED = 1234
BATCH, SEQ = 8, 12
CHUNK = 5  # smaller than the sequence and not a divisor of the token count: ragged last chunk
TEMPERATURE = 0.8
VOCAB = 301
LAYOUTS = [(2, 1), (1, 2), (2, 2), (1, 1)]  # on 4 ranks: TP2xDP2, PP2xDP2, TP2xPP2, DP4
NUM_MICROBATCHES = 2


# ---------------------------------------------------------------------------------------------
# HF config -> megatron config (in-process)


def test_qwen2_config_maps_every_field():
    hf = Qwen2Config(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=5e4,
        max_position_embeddings=77,
        initializer_range=0.05,
        tie_word_embeddings=True,
    )
    config = gpt_config_from_hf(hf, tp=2, pp=2, dtype=torch.float32)
    t = config.transformer
    assert (t.hidden_size, t.num_layers, t.num_attention_heads, t.num_query_groups) == (64, 4, 4, 2)
    assert (t.ffn_hidden_size, t.layernorm_epsilon, t.init_method_std) == (96, 1e-5, 0.05)
    assert t.normalization == "RMSNorm" and t.gated_linear_unit and not t.add_bias_linear
    assert t.activation_func is torch.nn.functional.silu
    assert t.add_qkv_bias and t.hidden_dropout == 0.0 and t.attention_dropout == 0.0
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) == (2, 2)
    assert t.params_dtype == torch.float32 and not t.bf16 and t.use_cpu_initialization
    assert config.rotary_base == 5e4 and config.rope_scaling_factor is None
    assert (config.vocab_size, config.padded_vocab_size, config.max_sequence_length) == (
        301,
        384,
        77,
    )
    assert config.tie_word_embeddings and config.model_type == "qwen2"


def test_llama_config_reads_head_dim_and_llama3_rope_and_rejects_attention_bias():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 5e5,
    }
    hf = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        attention_bias=False,
        max_position_embeddings=16384,
        rope_parameters=rope,
    )
    config = gpt_config_from_hf(hf)
    assert not config.transformer.add_qkv_bias and config.transformer.kv_channels == 32
    assert config.rotary_base == 5e5 and config.rope_scaling_factor == 8.0
    # HF's attention_bias also biases o_proj, which megatron-core cannot do without MLP biases.
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        gpt_config_from_hf(
            LlamaConfig(
                vocab_size=1000,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                attention_bias=True,
                rope_theta=1e4,
            )
        )


def test_config_from_transformers4_dict_with_rope_theta():
    # transformers 4 wrote rope_theta at the top level of config.json; a plain dict is accepted.
    config = gpt_config_from_hf(
        {
            "model_type": "qwen2",
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_theta": 1234.0,
        }
    )
    assert config.rotary_base == 1234.0 and config.transformer.num_query_groups == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        (
            {"num_key_value_heads": 3, "num_attention_heads": 3},
            "does not divide num_attention_heads=3",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type='yarn'",
        ),
    ],
)
def test_unsupported_configs_name_the_field(change, message):
    fields = {
        "model_type": "qwen2",
        "vocab_size": 50,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 1e4,
    }
    fields.update(change)
    tp = 2 if "num_key_value_heads" in change else 1
    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf(fields, tp=tp)


def test_unknown_override_is_rejected():
    with pytest.raises(ValueError, match="'no_such_field' is not a TransformerConfig field"):
        gpt_config_from_hf(tiny_qwen2_config(tied=True), overrides={"no_such_field": 1})


def test_padded_vocab_size_is_the_same_for_every_power_of_two_tp():
    assert [padded_vocab_size(301, tp) for tp in (1, 2, 4, 8)] == [384, 384, 384, 384]
    assert padded_vocab_size(384, 2) == 384 and padded_vocab_size(385, 1) == 512
    assert padded_vocab_size(100, 3, divisible_by=128) == 384  # lcm(128, 3) = 384
    with pytest.raises(ValueError, match="tensor_parallel must be positive"):
        padded_vocab_size(100, 0)


# ---------------------------------------------------------------------------------------------
# The 4-process job


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED + 1))


def _plain_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor):
    """Reference: torch log_softmax over the real vocabulary of full (unsharded) logits."""
    log_p = torch.log_softmax(logits[..., :VOCAB].float() / TEMPERATURE, dim=-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _function_check(tp_group) -> dict:
    """vocab_parallel_logprobs_and_entropy on random inputs vs full log_softmax: values, grads."""
    import torch.distributed as dist

    from grpo_mega.model import vocab_parallel_logprobs_and_entropy

    generator = torch.Generator().manual_seed(SEED + 2)
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    rows = padded_vocab_size(VOCAB, tp) // tp
    full_weight = torch.randn(padded_vocab_size(VOCAB, tp), 16, generator=generator)
    hidden = torch.randn(SEQ, 3, 16, generator=generator)
    labels = torch.randint(0, VOCAB, (SEQ, 3), generator=generator)
    weights = torch.randn(2, SEQ, 3, generator=generator)

    shard = full_weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    hidden_in = hidden.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(
        hidden_in,
        shard,
        labels,
        vocab_size=VOCAB,
        chunk_size=CHUNK,
        temperature=TEMPERATURE,
        tp_group=tp_group,
    )
    ((logprobs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()

    ref_weight = full_weight.clone().requires_grad_()
    ref_hidden = hidden.clone().requires_grad_()
    ref_logprobs, ref_entropy = _plain_logprobs_and_entropy(ref_hidden @ ref_weight.t(), labels)
    ((ref_logprobs * weights[0]).sum() + (ref_entropy * weights[1]).sum()).backward()
    return {
        "logprobs": (logprobs.detach(), ref_logprobs.detach()),
        "entropy": (entropy.detach(), ref_entropy.detach()),
        "grad_hidden": (hidden_in.grad, ref_hidden.grad),
        "grad_weight_shard": (shard.grad, ref_weight.grad[rank * rows : (rank + 1) * rows]),
    }


def _model_check(model) -> dict:
    """LMHead on the whole TP=1 model vs full log_softmax: values, and grads of every parameter."""
    from grpo_mega.model import LMHead, next_token_labels

    ids = _input_ids()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    weights = torch.randn(2, BATCH, SEQ, generator=torch.Generator().manual_seed(SEED + 3))
    head = LMHead(chunk_size=CHUNK, temperature=TEMPERATURE)

    def grads_of(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    out = head(model, model(ids, positions, None), {"input_ids": ids})
    chunked_grads = grads_of(
        (out["logprobs"] * weights[0]).sum() + (out["entropy"] * weights[1]).sum()
    )

    hidden = model(ids, positions, None)  # [S, B, H]
    logits = (hidden @ model.lm_output_weight().t()).transpose(0, 1)
    ref_logprobs, ref_entropy = _plain_logprobs_and_entropy(logits, next_token_labels(ids))
    ref_logprobs = torch.nn.functional.pad(ref_logprobs[:, :-1], (0, 1))
    ref_grads = grads_of((ref_logprobs * weights[0]).sum() + (ref_entropy * weights[1]).sum())
    return {
        "logprobs": (out["logprobs"].detach(), ref_logprobs.detach()),
        "entropy": (out["entropy"].detach(), ref_entropy.detach()),
        "grads": {name: (chunked_grads[name], ref_grads[name]) for name in ref_grads},
    }


def _scheduled_lm_head(model, input_ids: torch.Tensor) -> list[dict] | None:
    """Forward only through megatron's schedule (1F1B with PP): LM head outputs per micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from grpo_mega.model import LMHead

    head = LMHead(chunk_size=CHUNK, temperature=TEMPERATURE)
    micro_batches = input_ids.chunk(NUM_MICROBATCHES)

    def forward_step(data_iterator, stage):
        ids = next(data_iterator)
        hidden = stage(ids, torch.arange(SEQ).expand_as(ids), None)

        def loss_func(output_hidden):
            outputs = head(stage, output_hidden, {"input_ids": ids})
            return outputs["logprobs"].sum(), outputs

        return hidden, loss_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=micro_batches[0].shape[0],
        forward_only=True,
    )
    return outputs if parallel_state.is_pipeline_last_stage() else None


def _job(checkpoint_root: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=SEED, device="cpu")  # DP=4 over the 4 ranks
    rank = dist.get_rank()
    result: dict = {"layouts": {}, "reference": {}}
    # Groups of one rank give every rank a TP=1 group for the function check.
    single_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    for tied in (True, False):
        model = save_reference_weights(
            tiny_qwen2_config(tied=tied), os.path.join(checkpoint_root, f"tied_{tied}"), SEED
        )
        if rank == 0:
            result["reference"][tied] = _model_check(model)
    if rank == 0:
        result["function_tp1"] = _function_check(single_groups[0])
    for tp, pp in LAYOUTS:
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=SEED)
        if (tp, pp) == (2, 1):
            result["function_tp2"] = _function_check(
                parallel_state.get_tensor_model_parallel_group()
            )
        dp, dp_rank = (
            parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_rank(),
        )
        rows = torch.arange(BATCH).chunk(dp)[dp_rank]
        for tied in (True, False):
            model = load_reference_weights(
                tiny_qwen2_config(tied=tied), os.path.join(checkpoint_root, f"tied_{tied}")
            )
            with torch.no_grad():
                outputs = _scheduled_lm_head(model, _input_ids()[rows])
            if outputs is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
                result["layouts"][(tp, pp, tied)] = {
                    "rows": rows,
                    "logprobs": torch.cat([o["logprobs"] for o in outputs]),
                    "entropy": torch.cat([o["entropy"] for o in outputs]),
                }
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_distributed(_job, 4, str(tmp_path_factory.mktemp("reference_weights")))


def _assert_close(actual, expected, atol=1e-5, rtol=1e-5, what=""):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_function_matches_full_softmax_values_and_grads(job, tp):
    ranks = [0] if tp == 1 else [0, 1]
    for rank in ranks:
        check = job[rank][f"function_tp{tp}"]
        for name, (actual, expected) in check.items():
            _assert_close(actual, expected, what=f"tp={tp} rank={rank} {name}")
    # The grads must cover both real and padding rows: padding rows (>= VOCAB) get exactly zero.
    shard_grad = job[1]["function_tp2"]["grad_weight_shard"][0]
    assert shard_grad[VOCAB - 192 :].abs().max() == 0 and shard_grad[: VOCAB - 192].abs().max() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_matches_full_softmax_and_unchunked_grads_at_tp1(job, tied):
    check = job[0]["reference"][tied]
    logprobs, expected = check["logprobs"]
    # Spread-out distributions: a wrong label shift or vocab range could not pass by accident.
    assert logprobs[:, :-1].std() > 0.5 and (logprobs[:, -1] == 0).all()
    _assert_close(logprobs, expected, what="logprobs")
    _assert_close(*check["entropy"], what="entropy")
    assert len(check["grads"]) >= 4 * 6
    for name, (chunked, reference) in check["grads"].items():
        scale = reference.abs().max().item()
        assert scale > 0, name
        # fp32 rounding of sums over 96 tokens: tolerance relative to the gradient's own scale.
        _assert_close(
            chunked, reference, atol=1e-5 * max(1.0, scale), rtol=1e-5, what=f"grad {name}"
        )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp, pp", LAYOUTS, ids=["tp2-dp2", "pp2-dp2", "tp2-pp2", "dp4"])
def test_logprobs_equal_tp1_at_every_layout(job, tp, pp, tied):
    reference = job[0]["reference"][tied]
    expected_logprobs, expected_entropy = reference["logprobs"][0], reference["entropy"][0]
    pieces = [r["layouts"][(tp, pp, tied)] for r in job if (tp, pp, tied) in r["layouts"]]
    dp = 4 // (tp * pp)
    assert len(pieces) == dp  # one last-stage, TP-rank-0 reporter per data-parallel replica
    covered = torch.cat([piece["rows"] for piece in pieces]).sort().values
    assert torch.equal(covered, torch.arange(BATCH))
    for piece in pieces:
        _assert_close(piece["logprobs"], expected_logprobs[piece["rows"]], what="logprobs")
        _assert_close(piece["entropy"], expected_entropy[piece["rows"]], what="entropy")
