"""The decode loop of the ``hf`` rollout engine: token by token from a transformers causal LM and its KV cache, where
rows that have ended leave the batch.

transformers' ``generate`` keeps every row in the batch until the last one ends (or the length limit), computing
the layers, the attention over the whole cache and the logits for rows that finished long before: in a GRPO batch,
where G completions of one prompt end at very different lengths, much of the decode is spent on them. Here a row
that emits EOS or completes a stop string is marked finished, fed padding while it waits, and the batch is
compacted (its cache rows dropped, ``DynamicCache.batch_select_indices``) once the finished rows are a quarter of it
(``COMPACT_AT``): a compaction copies the cache once, as much as a decode step reads.

Sampling is exact and does not depend on the batch: every step draws one uniform number for EVERY row of the call
(finished or not) from the device's default generator, and a row's token is the inverse of its distribution's CDF
(after the masks and warpers) at its number. So a row's tokens are the same whichever rows are still in the batch,
with or without compaction (tests/test_rollout_hf_decode.py). Log-probs are ``log_softmax(logits / T)`` of the raw
logits after the masks (``rollout.base``), gathered at the sampled token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

COMPACT_AT = 0.25
"""Finished rows, as a share of the batch, at which the batch is compacted."""

ScoreFn = Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]
"""A transformers ``LogitsProcessor``: (input ids, [rows, vocab] scores) -> scores. The ones used here (the
past-tokenizer mask, temperature, top-k, top-p) read the scores only; they are passed no input ids."""


@dataclass
class Decoded:
    tokens: torch.Tensor
    """[rows, steps] generated ids; ``pad_token_id`` after a row's end."""
    logprobs: torch.Tensor
    """[rows, steps] float32 log-probs of those tokens (0 after a row's end), on the CPU."""
    row_steps: int
    """Sum over decode steps of the rows computed (finished rows waiting for a compaction included)."""


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] the token of each row whose CDF first exceeds ``uniform`` ([rows] in [0, 1)) x the row's total
    probability: exact sampling from ``probs`` ([rows, vocab], non-negative), never a zero-probability token."""
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1)
    overflow = chosen >= probs.shape[1]  # the target rounded up to the total: the last token with probability
    if overflow.any():
        last_possible = probs.shape[1] - 1 - (probs[overflow] > 0).flip(-1).long().argmax(-1)
        chosen[overflow] = last_possible
    return chosen


def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    masks: Sequence[ScoreFn] = (),
    warpers: Sequence[ScoreFn] = (),
    greedy: bool = False,
    logprob_temperature: float = 1.0,
    stopped: Callable[[list[int]], bool] | None = None,
    compact_at: float = COMPACT_AT,
) -> Decoded:
    """Generate up to ``max_new_tokens`` tokens after each row of ``input_ids`` ([rows, L], left-padded, with its
    ``attention_mask``), continuing ``cache``, which may already hold the first positions of every row (a shared
    prompt prefix; it is continued in place).

    ``masks`` apply to the raw logits (their log-softmax at ``logprob_temperature`` gives the log-probs),
    ``warpers`` then shape what is sampled; ``greedy`` takes the argmax instead. A row ends at an EOS id (kept)
    or once ``stopped`` says its tokens so far complete a stop string. ``compact_at`` > 1 never compacts.
    """
    rows = input_ids.shape[0]
    device = input_ids.device
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cached = cache.get_seq_length()
    step_input, step_positions = input_ids[:, cached:], positions[:, cached:]
    mask = attention_mask
    next_position = positions[:, -1] + 1
    batch_rows = torch.arange(rows, device=device)  # the call's row of each row in the batch
    live = torch.ones(rows, dtype=torch.bool, device=device)  # per batch row: not ended yet
    eos = torch.tensor(sorted(eos_token_ids), device=device)
    tokens = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device)
    row_steps = steps = 0
    for step in range(max_new_tokens):
        steps = step + 1
        row_steps += batch_rows.numel()
        logits = model(input_ids=step_input, attention_mask=mask, position_ids=step_positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1, :].float()
        for fn in masks:
            logits = fn(None, logits)
        scores = logits
        for fn in warpers:
            scores = fn(None, scores)
        if greedy:
            chosen = scores.argmax(dim=-1)
        else:
            uniform = torch.rand(rows, device=device)[batch_rows]  # one per row of the call, every step
            chosen = sample_inverse_cdf(torch.softmax(scores, dim=-1), uniform)
        chosen = torch.where(live, chosen, pad_token_id)
        chosen_logprobs = torch.log_softmax(logits / logprob_temperature, dim=-1).gather(1, chosen[:, None])[:, 0]
        tokens[batch_rows[live], step] = chosen[live]
        logprobs[batch_rows[live], step] = chosen_logprobs[live]
        ended = live & torch.isin(chosen, eos)
        if stopped is not None:
            for index in (live & ~ended).nonzero()[:, 0].tolist():
                ended[index] = stopped(tokens[batch_rows[index], : step + 1].tolist())
        live = live & ~ended
        if not live.any():
            break
        waiting = int((~live).sum())
        if waiting >= max(1.0, compact_at * live.numel()):
            keep = live.nonzero()[:, 0]
            cache.batch_select_indices(keep)
            batch_rows, live, mask, next_position, chosen = (
                batch_rows[keep], live[keep], mask[keep], next_position[keep], chosen[keep])
        step_input = chosen[:, None]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        step_positions = next_position[:, None]
        next_position = next_position + 1
    return Decoded(tokens=tokens[:, :steps], logprobs=logprobs[:, :steps].cpu(), row_steps=row_steps)
