"""fp32 logits (`model.logits_in_fp32`) for a bf16 policy: log-probs, entropies and gradients of the LM head
against an fp64 computation from the same bf16 hidden states and weights.

One 2-process gloo job at TP=2 (the vocab is sharded, with padding rows) builds a tiny Qwen2-shaped model in
bf16 and in fp32 and runs `LMHead` with `logits_in_fp32` on and off. The reference is computed in fp64 from the
model's own bf16 hidden states and (gathered) output matrix, so it measures the head's arithmetic alone.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed, tiny_qwen2_config

SEED = 7
BATCH, SEQ = 4, 16
CHUNK = 5  # ragged last chunk; the fp32 path also upcasts the weight CHUNK rows at a time
TEMPERATURE = 0.7
VOCAB = 301
LOGIT_SCALE = 2.0  # output matrix scaled up: logits spread like a trained model's


def _fp64_reference(hidden, full_weight, labels, loss_weights):
    """log p(label), entropy, and d(loss)/d(output matrix rows, hidden) in fp64 from the same bf16 values."""
    h = hidden.detach().double().requires_grad_()
    w = full_weight.detach().double().requires_grad_()
    log_p = torch.log_softmax((h @ w[:VOCAB].t()) / TEMPERATURE, dim=-1)
    logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((logprobs * loss_weights[0]).sum() + (entropy * loss_weights[1]).sum()).backward()
    return logprobs.detach(), entropy.detach(), h.grad, w.grad


def _run_head(model, ids, logits_in_fp32, loss_weights):
    from grpo_mega.model import LMHead

    model.zero_grad(set_to_none=True)
    hidden = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None)  # [S, B, H]
    hidden.retain_grad()
    head = LMHead(chunk_size=CHUNK, temperature=TEMPERATURE, logits_in_fp32=logits_in_fp32)
    out = head(model, hidden, {"input_ids": ids})
    ((out["logprobs"] * loss_weights[0]).sum() + (out["entropy"] * loss_weights[1]).sum()).backward()
    return hidden, out, {name: p.grad.clone() for name, p in model.named_parameters()}


def _job() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from grpo_mega.model import build_gpt_model, gpt_config_from_hf, next_token_labels
    from grpo_mega.parallel import init_distributed

    init_distributed(2, 1, seed=SEED, device="cpu")  # TP=2
    group = parallel_state.get_tensor_model_parallel_group()
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    loss_weights = torch.randn(2, BATCH, SEQ, generator=generator)
    loss_weights[0, :, -1] = 0  # the head's last log-prob (no next token) is a constant 0
    labels = next_token_labels(ids)
    result: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(SEED)
        model = build_gpt_model(gpt_config_from_hf(tiny_qwen2_config(tied=False), tp=2, pp=1, dtype=dtype))
        with torch.no_grad():
            model.lm_output_weight().mul_(LOGIT_SCALE)
        runs = {flag: _run_head(model, ids, flag, loss_weights) for flag in (True, False)}
        shard = model.lm_output_weight()
        pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, shard.detach().contiguous(), group=group)
        full_weight = torch.cat(pieces)
        rows = slice(dist.get_rank(group) * shard.shape[0], (dist.get_rank(group) + 1) * shard.shape[0])
        hidden = runs[True][0].transpose(0, 1)  # [B, S, H]: the same bf16 values in both runs
        ref_logprobs, ref_entropy, ref_grad_hidden, ref_grad_weight = _fp64_reference(
            hidden, full_weight, labels, loss_weights
        )
        weight_name = next(name for name, p in model.named_parameters() if p is shard)
        for flag, (hidden_out, out, grads) in runs.items():
            # The last position has no next token (logprob 0 by convention): compare the others.
            result[(dtype, flag)] = {
                "logprobs": out["logprobs"][:, :-1].detach().double(),
                "entropy": out["entropy"].detach().double(),
                "grad_hidden": hidden_out.grad.transpose(0, 1),
                "grad_weight": grads[weight_name],
                "grads": grads,
                "param_dtypes": {name: p.dtype for name, p in model.named_parameters()},
            }
        result[(dtype, "reference")] = {
            "logprobs": ref_logprobs[:, :-1],
            "entropy": ref_entropy,
            "grad_hidden": ref_grad_hidden,
            "grad_weight": ref_grad_weight[rows],
            "logit_std": (hidden.double() @ full_weight[:VOCAB].double().t()).std().item(),
        }
    return result


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, 2)


def _max_error(job, dtype, flag, name, rank=0):
    actual, expected = job[rank][(dtype, flag)][name], job[rank][(dtype, "reference")][name]
    return (actual.double() - expected.double()).abs().max().item()


def test_fp32_logits_bring_bf16_logprobs_and_entropy_closer_to_fp64(job):
    reference = job[0][(torch.bfloat16, "reference")]
    print(f"logit std {reference['logit_std']:.2f}, mean log p {reference['logprobs'].mean():.2f}")
    assert reference["logit_std"] > 2.0  # spread-out logits, not near-uniform
    for rank in (0, 1):
        for name in ("logprobs", "entropy"):
            with_fp32 = _max_error(job, torch.bfloat16, True, name, rank)
            without = _max_error(job, torch.bfloat16, False, name, rank)
            print(f"rank {rank} bf16 {name}: max |error| {with_fp32:.2e} with fp32 logits, {without:.2e} without")
            # bf16 logits are rounded to 8 significant bits (~1e-2 here); fp32 logits leave fp32 rounding only.
            assert without > 1e-3
            assert with_fp32 < 1e-4 and with_fp32 < without / 100, (name, with_fp32, without)


def test_fp32_logits_gradients_reach_bf16_parameters_in_their_dtype_and_are_closer(job):
    run = job[0][(torch.bfloat16, True)]
    assert run["grad_hidden"].dtype == torch.bfloat16
    assert all(grad.dtype == run["param_dtypes"][name] for name, grad in run["grads"].items())
    assert run["grad_weight"].dtype == torch.bfloat16  # the output matrix of a bf16 model
    assert all(grad.abs().max() > 0 for grad in run["grads"].values())
    for name in ("grad_hidden", "grad_weight"):
        scale = job[0][(torch.bfloat16, "reference")][name].abs().max().item()
        with_fp32 = _max_error(job, torch.bfloat16, True, name) / scale
        without = _max_error(job, torch.bfloat16, False, name) / scale
        print(f"bf16 {name}: max |error| / max |grad| {with_fp32:.2e} with fp32 logits, {without:.2e} without")
        # With fp32 logits the error is the bf16 rounding of the gradient (relative 2**-9 per rounding; at TP=2
        # the hidden-state gradient is the bf16 sum of two bf16 partials); bf16 logits add their own on top.
        assert with_fp32 <= 2**-7 and with_fp32 < without / 2, (name, with_fp32, without)


def test_fp32_model_is_identical_with_either_setting(job):
    for rank in (0, 1):
        on, off = job[rank][(torch.float32, True)], job[rank][(torch.float32, False)]
        for name in ("logprobs", "entropy", "grad_hidden"):
            assert torch.equal(on[name], off[name]), name
        assert on["grads"].keys() == off["grads"].keys()
        for name, grad in on["grads"].items():
            assert torch.equal(grad, off["grads"][name]), name
        # And it is the fp64 computation up to fp32 rounding.
        assert _max_error(job, torch.float32, True, "logprobs", rank) < 1e-4
