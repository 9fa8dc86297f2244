"""Check a converted model against its Hugging Face original: full logits of both, and how they differ.

`mcore_logits` runs the megatron model at any TP/PP through megatron's own pipeline schedule (the
path training uses) and gathers the vocab-parallel logits; `compare_logits` summarises the
difference and `judge_conversion` decides whether it is a right conversion. tools/compare_with_hf.py
and the conversion tests use them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather_vocab_shards(shard: torch.Tensor, tp_group) -> torch.Tensor:
    """Concatenate the TP ranks' vocab shards along the last dim (plain all_gather: megatron's
    gather_from_tensor_model_parallel_region allocates on torch.cuda.current_device())."""
    tp_size = dist.get_world_size(tp_group)
    if tp_size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def mcore_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, vocab_size] (fp32, padding columns dropped) of a megatron policy; collective.

    `model` is this rank's `HiddenStatesGPTModel` stage (possibly wrapped); every rank passes the
    same `input_ids` [B, S] and gets the same logits back. The forward runs as one micro-batch of
    `get_forward_backward_func(forward_only=True)`; the last stage multiplies its final hidden
    states by its vocab shard of the output matrix, all-gathers the shards over the TP group, and
    broadcasts the result over the PP group.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    device = next(gpt.parameters()).device
    input_ids = input_ids.to(device)
    batch_size, seq_len = input_ids.shape
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, -1)

    def forward_step(data_iterator, stage_model):
        tokens = next(data_iterator)
        # loss_func None: the schedule hands the last stage's output back as it is.
        return stage_model(tokens, positions, attention_mask=None), None

    was_training = model.training
    model.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([input_ids]),
            model=[model],
            num_microbatches=1,
            seq_length=seq_len,
            micro_batch_size=batch_size,
            forward_only=True,
        )
        logits = torch.empty(batch_size, seq_len, gpt.unpadded_vocab_size, device=device)
        if parallel_state.is_pipeline_last_stage():
            hidden = outputs[0].float()  # [S, B, H]
            shard = hidden @ gpt.lm_output_weight().float().t()  # [S, B, V_padded / tp]
            full = _gather_vocab_shards(shard, parallel_state.get_tensor_model_parallel_group())
            logits.copy_(full[..., : gpt.unpadded_vocab_size].transpose(0, 1))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
            dist.broadcast(logits, src=last, group=group)
    model.train(was_training)
    return logits


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor, margin: float = 0.0) -> dict[str, float]:
    """Differences between two logit tensors [..., V] of the same shape.

    Returns max_abs_diff = max |reference - candidate|; logit_scale = max |reference|; min_cosine and
    mean_cosine of the cosine similarity between the two logit vectors of each position;
    next_token_agreement = fraction of positions whose argmax (greedy next token) is the same; and
    decisive_agreement over the positions whose reference top-1 leads its top-2 by more than
    ``margin`` (``decisive_positions`` of them; 1.0 when there are none): there a right conversion
    cannot flip the greedy token, while a near-tie may flip from rounding alone.
    """
    if reference.shape != candidate.shape:
        raise ValueError(
            f"logit shapes differ: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}"
        )
    reference, candidate = reference.double(), candidate.double()
    cosine = torch.nn.functional.cosine_similarity(reference, candidate, dim=-1)
    agrees = reference.argmax(-1) == candidate.argmax(-1)
    top2 = reference.topk(2, dim=-1).values if reference.shape[-1] > 1 else None
    decisive = (top2[..., 0] - top2[..., 1] > margin) if top2 is not None else torch.ones_like(agrees)
    return {
        "max_abs_diff": (reference - candidate).abs().max().item(),
        "logit_scale": reference.abs().max().item(),
        "decisive_positions": int(decisive.sum()),
        "decisive_agreement": agrees[decisive].double().mean().item() if decisive.any() else 1.0,
        "min_cosine": cosine.min().item(),
        "mean_cosine": cosine.mean().item(),
        "next_token_agreement": agrees.double().mean().item(),
    }


DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-4
"""fp32 tolerances: a right conversion of a 30-layer model differs from transformers by rounding, which grows
with the logits (2.7e-4 on a 135M chat model whose logits reach ~30); a wrong shard moves them by a good part
of their scale. bf16 / fp16 runs need about 1e-2."""


def judge_conversion(reference: torch.Tensor, candidate: torch.Tensor, *, atol: float = DEFAULT_ATOL,
                     rtol: float = DEFAULT_RTOL) -> dict[str, float | bool | list[str]]:
    """``compare_logits`` plus the verdict: ``tolerance = atol + rtol * logit_scale``; the conversion passes when
    max |diff| <= tolerance and every decisive position (top-1 ahead of top-2 by more than the tolerance) has
    the same greedy token. ``failures`` says which check failed."""
    scale = reference.abs().max().item()
    tolerance = atol + rtol * scale
    result = compare_logits(reference, candidate, margin=tolerance)
    failures = []
    if result["max_abs_diff"] > tolerance:
        failures.append(f"max |logit diff| {result['max_abs_diff']:.3e} > tolerance {tolerance:.3e} "
                        f"(atol {atol:.1e} + rtol {rtol:.1e} x logit scale {scale:.3g})")
    if result["decisive_agreement"] < 1.0:
        failures.append(f"the greedy next token differs at "
                        f"{100 * (1 - result['decisive_agreement']):.2f}% of the {result['decisive_positions']} "
                        f"positions whose top-1 logit leads by more than the tolerance")
    return {**result, "tolerance": tolerance, "passed": not failures, "failures": failures}
