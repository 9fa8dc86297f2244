"""Per-token log-probabilities and entropy from vocab-parallel logits, in bounded memory.

Each TP rank holds a shard W_r [V/tp, H] of the output matrix. For a token with final hidden state h
and label y, with logits z = W h / T (temperature T) over the real vocabulary (padding rows
excluded):

    m = max_j z_j                      (all-reduce MAX over the TP group)
    s = sum_j exp(z_j - m)             (all-reduce SUM, with the two sums below in one call)
    log Z = m + log s
    log p(y) = z_y - log Z             (z_y lives on one rank: SUM of a one-hot pick)
    H = -sum_j p_j log p_j = log s - sum_j exp(z_j - m) (z_j - m) / s

No rank ever holds more than `chunk_size` x V/tp logits: tokens are processed in chunks, and the
backward pass recomputes each chunk's logits from (h, W, log Z, H), saved per token, instead of
keeping them. It needs no communication: with p_j = exp(z_j - log Z),

    d log p(y) / d z_j = [j = y] - p_j,        d H / d z_j = -p_j (log p_j + H),

and d z / d(W h) = 1 / T. The hidden-state gradient of each rank covers its vocab shard only; the
all-reduce that sums them is megatron's `copy_to_tensor_model_parallel_region` backward. Megatron's
own `vocab_parallel_cross_entropy` is not used: it keeps the [tokens, V/tp] softmax for backward
(memory grows with the batch) and gives no entropy.

Precision: everything after the product W h is fp32. With `logits_in_fp32` (the default) and a
bf16/fp16 model, W h itself is computed in fp32 too: the low-precision h and W are upcast (exactly)
and multiplied in fp32, so the logits are not rounded to bf16's 8 significant bits (a logit of 10
would otherwise carry an error of up to 0.03, straight into log p). W is upcast `chunk_size` rows at
a time, so the extra memory is a [chunk_size, H] fp32 block, not a copy of W; the backward product
dL/dz W is accumulated in fp32 the same way. Gradients reach h and W in their own dtype. fp32
models compute the same either way.

On a GPU, the logit products h W^T of upcast bf16/fp16 operands (forward, and its recomputation in backward) run
with TF32 allowed (`grpo_mega.model.tf32`): both operands are exact in TF32, so the tensor cores compute the same
products with fp32 accumulation, instead of the fp32 cores' IEEE path at a seventh of the rate. The two backward
products with dL/dz keep IEEE fp32: dL/dz is a genuine fp32 value that TF32 would round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

from grpo_mega.model.tf32 import tf32_if_exact

DEFAULT_CHUNK_SIZE = 1024


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _ShardGeometry:
    """Which global token ids this rank's weight rows stand for, and which of them are real."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group) -> None:
        rows = weight.shape[0]
        self.start = dist.get_rank(group) * rows
        # Padding rows sit at the end of the padded vocabulary; a shard may hold none, some or only.
        self.real_rows = max(0, min(rows, vocab_size - self.start))

    def local_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels as row indices of this shard, clamped; mask of the labels in this shard)."""
        local = labels - self.start
        in_shard = (local >= 0) & (local < self.real_rows)
        return local.clamp(0, max(self.real_rows - 1, 0)), in_shard


def _upcast_matmuls(hidden_dtype: torch.dtype, weight_dtype: torch.dtype, logits_in_fp32: bool) -> bool:
    """Whether the products with the output matrix run on fp32 copies of low-precision operands."""
    return logits_in_fp32 and (hidden_dtype != torch.float32 or weight_dtype != torch.float32)


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, logits_in_fp32: bool, block_rows: int
) -> torch.Tensor:
    """fp32 logits z = h W^T / T of one chunk over the real rows: one [chunk, V/tp] buffer.

    With logits_in_fp32 and bf16/fp16 operands, the product itself is computed in fp32 (exact products of the
    low-precision values, fp32 accumulation and result), `block_rows` rows of W upcast at a time, as TF32 on a GPU
    when both are bf16/fp16 (exact: module docstring); otherwise it is computed in the operands' dtype and its
    result upcast (a bf16 matmul rounds every logit to 8 significant bits). fp32 operands take the same plain
    matmul either way.
    """
    if _upcast_matmuls(hidden.dtype, weight.dtype, logits_in_fp32):
        hidden32 = hidden.float()
        logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
        with tf32_if_exact(hidden.dtype, weight.dtype):
            for begin in range(0, weight.shape[0], block_rows):
                block = weight[begin : begin + block_rows]
                logits[:, begin : begin + block.shape[0]] = hidden32 @ block.float().t()
    else:
        logits = torch.matmul(hidden, weight.t()).float()
    if temperature != 1.0:
        logits /= temperature
    return logits


def _chunk_grad_hidden(
    grad_logits: torch.Tensor, weight: torch.Tensor, logits_in_fp32: bool, block_rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """dL/dh = dL/dz W of one chunk, returned in `dtype` (the hidden states').

    With fp32 logits and low-precision W, accumulated in fp32 over blocks of `block_rows` rows of W and rounded
    once, in IEEE fp32 (dL/dz is not exact in TF32); otherwise dL/dz is cast to W's dtype and multiplied there (as
    the forward product was).
    """
    if _upcast_matmuls(dtype, weight.dtype, logits_in_fp32):
        grad = torch.zeros(grad_logits.shape[0], weight.shape[1], dtype=torch.float32, device=weight.device)
        for begin in range(0, weight.shape[0], block_rows):
            block = weight[begin : begin + block_rows]
            grad.addmm_(grad_logits[:, begin : begin + block.shape[0]], block.float())
        return grad.to(dtype)
    return (grad_logits.to(weight.dtype) @ weight).to(dtype)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Chunked log p(label) and entropy over a vocab-parallel output matrix (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, chunk_size, temperature, logits_in_fp32, group):
        shard = _ShardGeometry(weight, vocab_size, group)
        real_weight = weight[: shard.real_rows]
        tokens = hidden.shape[0]
        logprobs = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        log_normalizer = torch.empty_like(logprobs)
        for begin in range(0, tokens, chunk_size):
            end = min(begin + chunk_size, tokens)
            rows = end - begin
            shifted = _chunk_logits(hidden[begin:end], real_weight, temperature, logits_in_fp32, chunk_size)
            if shard.real_rows > 0:
                local_max = shifted.max(dim=-1).values
            else:
                local_max = torch.full((rows,), -torch.inf, device=hidden.device)
            chunk_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
            shifted -= chunk_max.unsqueeze(-1)
            exp_shifted = shifted.exp()
            local_labels, in_shard = shard.local_labels(labels[begin:end])
            if shard.real_rows > 0:
                picked = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
            else:
                picked = torch.zeros(rows, device=hidden.device)
            sums = torch.stack(
                (
                    exp_shifted.sum(dim=-1),
                    # Row-wise dot product as a batched matmul: no third [rows, V/tp] buffer.
                    torch.bmm(exp_shifted.unsqueeze(1), shifted.unsqueeze(2)).view(rows),
                    torch.where(in_shard, picked, 0.0),
                )
            )
            del shifted, exp_shifted
            sum_exp, sum_exp_shifted, target_shifted = _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_sum_exp = sum_exp.log()
            logprobs[begin:end] = target_shifted - log_sum_exp
            entropy[begin:end] = log_sum_exp - sum_exp_shifted / sum_exp
            log_normalizer[begin:end] = chunk_max + log_sum_exp
        ctx.save_for_backward(hidden, weight, labels, log_normalizer, entropy)
        ctx.shard, ctx.chunk_size, ctx.temperature = shard, chunk_size, temperature
        ctx.logits_in_fp32 = logits_in_fp32
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, log_normalizer, entropy = ctx.saved_tensors
        shard = ctx.shard
        real_weight = weight[: shard.real_rows]
        grad_hidden = torch.zeros_like(hidden)
        # Accumulated in fp32 over chunks and cast once (exact for fp32 weights).
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(entropy)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(entropy)
        for begin in range(0, hidden.shape[0] if shard.real_rows else 0, ctx.chunk_size):
            end = min(begin + ctx.chunk_size, hidden.shape[0])
            chunk_hidden = hidden[begin:end]
            g_logp = grad_logprobs[begin:end]
            log_p = _chunk_logits(chunk_hidden, real_weight, ctx.temperature, ctx.logits_in_fp32, ctx.chunk_size)
            log_p -= log_normalizer[begin:end].unsqueeze(-1)
            probs = log_p.exp()
            # dL/dz_j = -p_j * (g_logp + g_entropy * (log p_j + H)) + g_logp * [j = label]
            grad_logits = (
                log_p.add_(entropy[begin:end].unsqueeze(-1))
                .mul_(grad_entropy[begin:end].unsqueeze(-1))
                .add_(g_logp.unsqueeze(-1))
                .mul_(probs)
                .neg_()
            )
            del probs
            local_labels, in_shard = shard.local_labels(labels[begin:end])
            grad_logits.scatter_add_(
                -1, local_labels.unsqueeze(-1), torch.where(in_shard, g_logp, 0.0).unsqueeze(-1)
            )
            grad_logits /= ctx.temperature
            grad_hidden[begin:end] = _chunk_grad_hidden(
                grad_logits, real_weight, ctx.logits_in_fp32, ctx.chunk_size, hidden.dtype
            )
            grad_weight[: shard.real_rows].addmm_(grad_logits.t(), chunk_hidden.float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    logits_in_fp32: bool = True,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each label and entropy of each next-token distribution, vocab-parallel.

    hidden_states [..., H] (the same on every TP rank), weight [V_padded / tp, H] (this rank's rows
    of the output matrix), labels [...] (global token ids in [0, vocab_size)). Logits are
    h W^T / temperature over the first `vocab_size` rows of the full matrix (padding rows ignored);
    with `logits_in_fp32`, h W^T is computed in fp32 even for bf16/fp16 inputs (module docstring).
    Returns (log p(label), entropy), both fp32 with the shape of labels; differentiable w.r.t.
    hidden_states and weight. Peak extra memory is O(chunk_size x V/tp) in forward and backward.
    tp_group defaults to megatron's tensor-parallel group. See the module docstring for the math.
    """
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and labels {tuple(labels.shape)} "
            "disagree on the token dimensions"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    if weight.shape[0] * dist.get_world_size(group) < vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the {weight.shape[0]} x "
            f"{dist.get_world_size(group)} rows of the sharded output weight"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab_size):
        raise ValueError(f"labels must lie in [0, vocab_size={vocab_size})")
    hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        vocab_size,
        chunk_size,
        float(temperature),
        bool(logits_in_fp32),
        group,
    )
    return logprobs.view(labels.shape), entropy.view(labels.shape)


def logprobs_and_entropy_at(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    *,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    logits_in_fp32: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vocab_parallel_logprobs_and_entropy`` at the ``positions`` read only, 0 elsewhere.

    hidden_states [S, B, H] (megatron's order), labels and positions (bool) [B, S]: only the read positions' hidden
    states go through the output matrix (a prompt, padding or a packed row's prompt copies would otherwise cost
    most of the head's products). Returns (log p(label), entropy) [B, S], fp32, differentiable like the full one."""
    if positions.shape != labels.shape:
        raise ValueError(f"read positions {tuple(positions.shape)} do not match labels {tuple(labels.shape)}")
    positions = positions.to(torch.bool)
    picked_logprobs, picked_entropy = vocab_parallel_logprobs_and_entropy(
        hidden_states.transpose(0, 1)[positions], weight, labels[positions], vocab_size=vocab_size,
        chunk_size=chunk_size, temperature=temperature, logits_in_fp32=logits_in_fp32,
    )
    zeros = torch.zeros(labels.shape, dtype=picked_logprobs.dtype, device=picked_logprobs.device)
    return zeros.masked_scatter(positions, picked_logprobs), zeros.masked_scatter(positions, picked_entropy)
