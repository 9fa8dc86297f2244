"""Turning token sequences into the engine's batch layout (``grpo_mega.engine.base``): right-padded rows of
``prompt + response`` with masks aligned to token positions."""

from __future__ import annotations

from typing import Sequence

import torch


def sequences_to_batch(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Rows ``prompt + response`` right-padded with ``pad_id``.

    Returns ``input_ids`` [B, L], ``attention_mask`` [B, L] (real tokens), ``loss_mask`` [B, L] (response
    tokens), ``prompt_lengths`` [B] and ``response_lengths`` [B]. Position ``prompt_lengths[b] + k`` holds the k-th
    response token of row b. ``response_masks`` (0/1 per response token, e.g. 0 on a tool turn's tokens) clears
    ``loss_mask`` where it is 0; the tokens stay in the row as context.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    response_lengths = torch.tensor([len(r) for r in response_ids], dtype=torch.long)
    if (prompt_lengths == 0).any():
        raise ValueError(f"row {int((prompt_lengths == 0).nonzero()[0])} has an empty prompt")
    total = prompt_lengths + response_lengths
    width = int(total.max())
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[row, : len(prompt) + len(response)] = torch.tensor(list(prompt) + list(response), dtype=torch.long)
    positions = torch.arange(width)
    attention_mask = (positions < total[:, None]).long()
    loss_mask = ((positions >= prompt_lengths[:, None]) & (positions < total[:, None])).long()
    if response_masks is not None:
        if [len(m) for m in response_masks] != response_lengths.tolist():
            raise ValueError("response_masks must have one 0/1 value per response token of each row")
        for row, mask in enumerate(response_masks):
            start = int(prompt_lengths[row])
            loss_mask[row, start : start + len(mask)] *= torch.tensor(list(mask), dtype=torch.long)
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
    )


def mask_response_tokens(batch: dict[str, torch.Tensor], masks: Sequence[Sequence[int] | None]) -> None:
    """Multi-turn rollouts: ``loss_mask`` of row b's k-th response token becomes ``masks[b][k]`` (1 = the policy
    sampled it, 0 = a tool's output or a template boundary); a None mask keeps the row's response all 1. Every term
    that reads ``loss_mask`` (policy loss, KL, entropy, the sampler-vs-trainer log-prob diff, the token counts the
    loss is normalised by) then skips the tool tokens."""
    for row, mask in enumerate(masks):
        if mask is None:
            continue
        start, length = int(batch["prompt_lengths"][row]), int(batch["response_lengths"][row])
        if len(mask) != length:
            raise ValueError(f"row {row}: response mask of {len(mask)} tokens for a response of {length}")
        batch["loss_mask"][row, start:start + length] = torch.tensor(list(mask), dtype=batch["loss_mask"].dtype)


def response_values_to_tokens(batch: dict[str, torch.Tensor], values: Sequence[Sequence[float]]) -> torch.Tensor:
    """Place per-response-token values (e.g. sampling log-probs) at their positions in a [B, L] tensor."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for row, row_values in enumerate(values):
        start = int(batch["prompt_lengths"][row])
        out[row, start : start + len(row_values)] = torch.tensor(list(row_values), dtype=torch.float32)
    return out


def routes_to_tokens(batch: dict[str, torch.Tensor], routes: Sequence) -> torch.Tensor:
    """The experts each token of a ``prompt + response`` row was routed to in the rollout (routing replay), laid out
    [B, L, layers, top-k] like ``input_ids``: ``routes[b]`` ([tokens, layers, top-k], numpy or torch) gives row b's
    first ``len(routes[b])`` positions. The other positions (a row's last token, never put through the rollout
    model, and padding) get experts 0..k-1: valid, distinct ids for megatron's replay; they reach no loss (a causal
    model's last position predicts nothing the batch holds, and padding is outside every real token's attention).
    uint8 while every id fits (up to 256 experts, as vLLM returns them), else int16."""
    tensors = [torch.as_tensor(r) for r in routes]
    if len(tensors) != batch["input_ids"].shape[0]:
        raise ValueError(f"{len(tensors)} routes for {batch['input_ids'].shape[0]} rows")
    shapes = {tuple(t.shape[1:]) for t in tensors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"routes must all be [tokens, layers, top-k] with the same layers and top-k, got {shapes}")
    layers, topk = next(iter(shapes))
    largest = max((int(t.max()) for t in tensors if t.numel()), default=0)
    dtype = torch.uint8 if largest < 256 else torch.int16
    rows, width = batch["input_ids"].shape
    out = torch.arange(topk, dtype=dtype).expand(rows, width, layers, topk).clone()
    for row, route in enumerate(tensors):
        if len(route) > width:
            raise ValueError(f"row {row}: {len(route)} routed tokens for a row of {width}")
        out[row, :len(route)] = route.to(dtype)
    return out
