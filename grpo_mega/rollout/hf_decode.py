"""The decode loop of the ``hf`` rollout engine: token by token from a transformers causal LM and its KV cache, where
rows that have ended leave the batch, with the host reading the device only once every ``sync_every`` steps.

transformers' ``generate`` keeps every row in the batch until the last one ends (or the length limit), computing
the layers, the attention over the whole cache and the logits for rows that finished long before: in a GRPO batch,
where G completions of one prompt end at very different lengths, much of the decode is spent on them. Here a row
that emits EOS is marked finished on the device, fed padding while it waits, and the batch is compacted (its cache
rows dropped, ``DynamicCache.batch_select_indices``) once the finished rows are a quarter of it (``COMPACT_AT``): a
compaction copies the cache once, as much as a decode step reads.

Host round trips. On a GPU every read of a device value on the host (``.item()``, ``bool(tensor)``, ``nonzero``, a
copy to the CPU) waits for every queued kernel and leaves the GPU idle while Python launches the next ones. The loop
reads the device at a *checkpoint* every ``sync_every`` steps (16 on CUDA, every step on the CPU, where a read costs
nothing and an early exit saves whole steps): one copy of the rows' ``live`` flags (and, with a ``stopped`` callback,
the tokens since the last checkpoint), from which the host decides the exit, the compaction and the stop strings;
at the end one copy brings the tokens and log-probs. Between checkpoints nothing is read: ``live`` is updated on the
device, tokens are written with ``index_copy_``, the attention mask and the positions are built once per call and
sliced. A stop string completed between checkpoints is found at the next one: the tokens after it are dropped (they
were sampled from the row's own noise, so the tokens before it are unchanged). Measured by
tests/test_rollout_hf_decode_syncs.py: at most one host read per ``sync_every`` steps.

Sampling is exact and does not depend on the batch (``grpo_mega.rollout.sampling``: an exponential race on CUDA, the
inverse CDF elsewhere, neither sorting the vocabulary): the random numbers are drawn for every row of the call at every
step, so a row's tokens are the same whichever rows are still in the batch, with or without compaction, and whatever
``sync_every`` (tests/test_rollout_hf_decode.py). Log-probs are ``log_softmax(logits / T)``
of the raw logits after the masks (``rollout.base``), gathered at the sampled token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from grpo_mega.rollout.kv_cache import take_row_cache
from grpo_mega.rollout.sampling import TokenSampler, method_for
from grpo_mega.rollout.static_decode import StaticDecoder

COMPACT_AT = 0.25
"""Finished rows, as a share of the batch, at which the batch is compacted."""

SYNC_EVERY_CUDA = 16
"""Decode steps between host reads of the device on CUDA (the exit, compaction and stop-string checks). A batch whose
rows have all ended runs at most this many - 1 steps more; a read costs a drained launch queue (~the step itself)."""

ScoreFn = Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]
"""A transformers ``LogitsProcessor``: (input ids, [rows, vocab] scores) -> scores. The ones used here (the
past-tokenizer mask) read the scores only; they are passed no input ids."""


@dataclass
class Decoded:
    tokens: torch.Tensor
    """[rows, steps] generated ids on the CPU; ``pad_token_id`` after a row's end."""
    logprobs: torch.Tensor
    """[rows, steps] float32 log-probs of those tokens (0 after a row's end), on the CPU."""
    row_steps: int
    """Sum over decode steps of the rows computed (finished rows waiting for a compaction included)."""
    prefill_tokens: int = 0
    """Positions of the first step's forward pass (rows x the input's uncached columns, padding included)."""
    kept: dict[int, tuple] = field(default_factory=dict)
    """With ``keep_columns``: call row -> its cache (``kv_cache.take_row_cache``) for each row a stop string ended."""


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` on the CPU: the loop's only way to read the device (on CUDA a sync; on the CPU a copy
    too, so that tests count the reads the CUDA path makes)."""
    return tensor.to("cpu", copy=True)


class _StopScan:
    """Host side of the stop strings: each row's tokens as far as read, and where ``stopped`` ended rows."""

    def __init__(self, rows: int, eos: set[int], stopped: Callable[[list[int]], bool]):
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.ends: dict[int, int] = {}  # call row -> index of the token that completed a stop string
        self.finished: set[int] = set()  # rows ended by EOS or a stop string
        self.eos, self.stopped = eos, stopped

    def scan(self, call_rows: list[int], window: list[list[int]]) -> list[int]:
        """Append each row's ``window`` (its tokens since the last scan) and check every new prefix as the
        per-step loop did (not at an EOS, not after the row's end). Returns the rows that a stop string ended."""
        ended = []
        for row, new in zip(call_rows, window):
            tokens = self.tokens[row]
            for token in new:
                if row in self.finished:
                    break
                tokens.append(token)
                if token in self.eos:
                    self.finished.add(row)
                elif self.stopped(list(tokens)):
                    self.finished.add(row)
                    self.ends[row] = len(tokens) - 1
                    ended.append(row)
        return ended


def _sdpa_full_attention(model: torch.nn.Module) -> bool:
    """Whether every layer of ``model`` is full attention through SDPA (the 4D boolean decode mask applies)."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return getattr(config, "_attn_implementation", None) == "sdpa" and layer_types == {"full_attention"}


def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    masks: Sequence[ScoreFn] = (),
    sampler: TokenSampler | None = None,
    greedy: bool = False,
    logprob_temperature: float = 1.0,
    stopped: Callable[[list[int]], bool] | None = None,
    compact_at: float = COMPACT_AT,
    sync_every: int | None = None,
    keep_columns: Sequence[torch.Tensor] | None = None,
    static: StaticDecoder | None = None,
) -> Decoded:
    """Generate up to ``max_new_tokens`` tokens after each row of ``input_ids`` ([rows, L], left-padded, with its
    ``attention_mask``; None when no row is padded, which spares transformers a check of the mask at every step),
    continuing ``cache``, which may already hold the first positions of every row (a shared prompt prefix; it is
    continued in place).

    ``masks`` apply to the raw logits (their log-softmax at ``logprob_temperature`` gives the log-probs),
    ``sampler`` (default: temperature 1, no top-k / top-p, the device's method) then draws; ``greedy`` takes the argmax instead. A row
    ends at an EOS id (kept) or once ``stopped`` says its tokens so far complete a stop string. ``compact_at`` > 1
    never compacts. ``sync_every``: steps between host reads (default :data:`SYNC_EVERY_CUDA` on CUDA, 1 elsewhere).

    ``keep_columns[r]`` (with ``stopped``): the cache columns of call row r's real input tokens (a LongTensor on the
    device, in order). The cache of each row a stop string ends is then kept (``Decoded.kept``): its keys and values
    at those columns and at its generated tokens before the one that completed the stop string (never fed), cut out
    before a compaction drops the row or at the end, with no host read of its own.

    ``static``: the decode steps after the first (the prefill, eager into ``cache``) run over a static KV cache
    (``grpo_mega.rollout.static_decode``: eager, compiled or CUDA graphs); the batch then shrinks only to the next
    smaller bucket (``StaticDecoder.wants_shrink``) instead of at ``compact_at``.
    """
    if sync_every is None:
        sync_every = SYNC_EVERY_CUDA if input_ids.device.type == "cuda" else 1
    if sync_every < 1:
        raise ValueError(f"decode: sync_every must be >= 1, got {sync_every}")
    sampler = sampler or TokenSampler(method=method_for(input_ids.device))
    if static is not None and not _sdpa_full_attention(model):
        raise ValueError("decode: a static KV cache needs a model whose layers are all full attention through SDPA")
    rows, length = input_ids.shape
    device = input_ids.device
    cached = cache.get_seq_length()
    steps_ahead = torch.arange(1, max_new_tokens + 1, device=device)
    if attention_mask is None:
        prompt_positions = torch.arange(length, device=device).expand(rows, length)
        full_mask = None
    else:
        prompt_positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        full_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, max_new_tokens)], dim=1)
    # Given a 2D padding mask, transformers checks at every step whether it has padding
    # (``masking_utils._ignore_causal_mask_sdpa``: a host read). For one-token steps of an all-SDPA full-attention
    # model, the 4D boolean mask SDPA takes (True = attend; one query sees every cached position) is a slice of one
    # tensor, handed over as a 4D tensor, which ``create_causal_mask`` returns as is (every model class goes through it;
    # a per-layer-type dict would be taken as is by Qwen2 / Llama but not by Qwen3-MoE, whose forward has no mapping).
    mask_4d = full_mask.bool()[:, None, None, :] if full_mask is not None and _sdpa_full_attention(model) else None
    # Built once, sliced per step: the position of generated token s is the prompt's last position + 1 + s.
    positions = prompt_positions[:, -1:] + steps_ahead
    step_input, step_positions = input_ids[:, cached:], prompt_positions[:, cached:]
    batch_rows = torch.arange(rows, device=device)  # the call's row of each row in the batch
    host_rows = list(range(rows))
    live = torch.ones(rows, dtype=torch.bool, device=device)  # per batch row: not ended yet
    eos = torch.tensor(sorted(eos_token_ids), device=device, dtype=torch.long)
    tokens = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device)
    scan = _StopScan(rows, set(eos_token_ids), stopped) if stopped is not None else None
    scanned = 0  # tokens of every row the stop scan has read
    row_steps = steps = 0
    kept: dict[int, tuple] = {}

    def keep(batch_indices: Sequence[int]) -> None:
        """Cut out the caches of the rows at ``batch_indices`` that a stop string ended (while still in ``cache``)."""
        if keep_columns is None or scan is None:
            return
        for index in batch_indices:
            row = host_rows[index]
            if row in scan.ends and row not in kept:
                generated = torch.arange(length, length + scan.ends[row], device=device)
                kept[row] = take_row_cache(cache if static is None else static.cache, index,
                                           torch.cat([keep_columns[row], generated]))

    for step in range(max_new_tokens):
        steps = step + 1
        row_steps += len(host_rows)
        if full_mask is None:
            mask = None
        elif mask_4d is not None and step_input.shape[1] == 1:
            mask = mask_4d[..., : length + step]
        else:
            mask = full_mask[:, : length + step]
        if static is not None and step > 0:  # the token fed at step s is generated token s - 1: its column
            logits = static.step(step_input, step_positions, length + step - 1)
        else:
            logits = model(input_ids=step_input, attention_mask=mask, position_ids=step_positions,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :].float()
            if static is not None and max_new_tokens > 1:
                static.begin(cache, rows, length, max_new_tokens,
                             None if full_mask is None else full_mask[:, :length])
        for fn in masks:
            logits = fn(None, logits)
        if greedy:
            chosen = logits.argmax(dim=-1)
        else:
            chosen = sampler.sample(logits, rows, batch_rows if len(host_rows) < rows else None)
        chosen = torch.where(live, chosen, pad_token_id)
        chosen_logprobs = torch.log_softmax(logits / logprob_temperature, dim=-1).gather(1, chosen[:, None])[:, 0]
        tokens[:, step].index_copy_(0, batch_rows, chosen)
        logprobs[:, step].index_copy_(0, batch_rows, torch.where(live, chosen_logprobs, 0.0))
        live = live & ~torch.isin(chosen, eos)
        if steps == max_new_tokens:
            break
        if steps % sync_every == 0:  # the checkpoint: one read of the device
            if scan is None:
                live_host = to_host(live).tolist()
            else:
                packed = to_host(torch.cat([live[:, None].long(), tokens.index_select(0, batch_rows)[:, scanned:steps]],
                                           dim=1)).tolist()
                live_host = [bool(row[0]) for row in packed]
                ended = set(scan.scan(host_rows, [row[1:] for row in packed]))
                scanned = steps
                if ended:
                    live_host = [alive and row not in ended for alive, row in zip(live_host, host_rows)]
                    live = torch.tensor(live_host, device=device)
            if not any(live_host):
                break
            waiting = live_host.count(False)
            if (waiting >= max(1.0, compact_at * len(live_host)) if static is None
                    else static.wants_shrink(len(live_host) - waiting)):
                keep_host = [index for index, alive in enumerate(live_host) if alive]
                keep([index for index, alive in enumerate(live_host) if not alive])
                kept_rows = torch.tensor(keep_host, device=device)
                if static is None:
                    cache.batch_select_indices(kept_rows)
                else:
                    static.select(kept_rows, len(keep_host))
                host_rows = [host_rows[index] for index in keep_host]
                batch_rows, live, positions, chosen = (
                    batch_rows[kept_rows], live[kept_rows], positions[kept_rows], chosen[kept_rows])
                full_mask = None if full_mask is None else full_mask[kept_rows]
                mask_4d = None if mask_4d is None else mask_4d[kept_rows]
        step_input = chosen[:, None]
        step_positions = positions[:, step: step + 1]
    # The end: one copy of tokens and log-probs (the log-probs' float32 bits carried exactly as integers).
    packed = to_host(torch.stack([tokens[:, :steps], logprobs[:, :steps].view(torch.int32).long()]))
    tokens_host, logprobs_host = packed[0], packed[1].int().view(torch.float32)
    if scan is not None:
        live_rows = [row for row in range(rows) if row not in scan.finished]
        scan.scan(live_rows, tokens_host[live_rows, scanned:].tolist())
        for row, end in scan.ends.items():  # tokens sampled after a stop string, before the check found it
            tokens_host[row, end + 1:] = pad_token_id
            logprobs_host[row, end + 1:] = 0.0
        keep(range(len(host_rows)))
    return Decoded(tokens=tokens_host, logprobs=logprobs_host, row_steps=row_steps,
                   prefill_tokens=rows * (length - cached), kept=kept)
