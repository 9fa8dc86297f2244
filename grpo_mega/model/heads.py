"""Pluggable heads: what the last pipeline stage computes from the backbone's final hidden states.

A head is called as `head(backbone, hidden_states, batch)` with the unwrapped `HiddenStatesGPTModel`
of the last stage, its final-normed hidden states [S, B, H], and the micro-batch dict; it returns a
dict of per-token tensors [B, S]. Heads are `torch.nn.Module`s so that a head with its own
parameters (the PRM step scorer) can be registered on the last stage and be seen by DDP, the
optimizer and checkpoints like any other parameter; `LMHead` has none: it reuses the backbone's
output matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from grpo_mega.model.gpt import HiddenStatesGPTModel
from grpo_mega.model.logprobs import (
    DEFAULT_CHUNK_SIZE,
    logprobs_and_entropy_at,
    vocab_parallel_logprobs_and_entropy,
)


READ_POSITIONS = "read_positions"
"""Micro-batch key: [B, S] bool, the positions whose next-token outputs anything reads (``LMHead``)."""


class TokenHead(Protocol):
    """Maps final hidden states [S, B, H] and the micro-batch to per-token outputs [B, S]."""

    def __call__(
        self,
        backbone: HiddenStatesGPTModel,
        hidden_states: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]: ...


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t + 1]; the last column (no next token) repeats the last id."""
    return torch.cat((input_ids[:, 1:], input_ids[:, -1:]), dim=1)


class LMHead(torch.nn.Module):
    """Next-token log-probabilities and entropies from the backbone's vocab-parallel output matrix.

    Returns {"logprobs", "entropy"}, fp32 [B, S]: logprobs[b, t] = log p(labels[b, t] | tokens <= t)
    with logits / temperature, where labels = batch["labels"] if given, else input_ids shifted left
    by one (then logprobs[:, -1] = 0: there is no next token); entropy[b, t] is the entropy of the
    same next-token distribution. Memory is bounded by chunk_size x V/tp (see `logprobs`).
    With ``batch[READ_POSITIONS]`` [B, S] (bool), only those positions go through the output matrix and both
    outputs are 0 elsewhere (the engine sets it from ``loss_mask``: prompt and padding are never read).
    With logits_in_fp32 (default), the logits h W^T of a bf16/fp16 model are computed in fp32
    instead of being rounded to the model's dtype before the softmax; fp32 models are unaffected.
    """

    def __init__(
        self,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        temperature: float = 1.0,
        logits_in_fp32: bool = True,
    ) -> None:
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.logits_in_fp32 = logits_in_fp32

    def forward(
        self,
        backbone: HiddenStatesGPTModel,
        hidden_states: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Compute {"logprobs", "entropy"} [B, S] for the micro-batch (see the class docstring)."""
        labels = batch.get("labels")
        shifted = labels is None
        if shifted:
            labels = next_token_labels(batch["input_ids"])
        seq_len, batch_size = hidden_states.shape[:2]
        if labels.shape != (batch_size, seq_len):
            raise ValueError(
                f"labels {tuple(labels.shape)} do not match hidden states [S={seq_len}, "
                f"B={batch_size}]"
            )
        positions = batch.get(READ_POSITIONS)
        if positions is None:
            logprobs, entropy = vocab_parallel_logprobs_and_entropy(
                hidden_states,
                backbone.lm_output_weight(),
                labels.t(),
                vocab_size=backbone.unpadded_vocab_size,
                chunk_size=self.chunk_size,
                temperature=self.temperature,
                logits_in_fp32=self.logits_in_fp32,
            )
            logprobs, entropy = logprobs.t(), entropy.t()
        else:  # the output matrix at the positions read only; 0 elsewhere
            logprobs, entropy = logprobs_and_entropy_at(
                hidden_states,
                backbone.lm_output_weight(),
                labels,
                positions,
                vocab_size=backbone.unpadded_vocab_size,
                chunk_size=self.chunk_size,
                temperature=self.temperature,
                logits_in_fp32=self.logits_in_fp32,
            )
        if shifted:
            logprobs = torch.nn.functional.pad(logprobs[:, :-1], (0, 1), value=0.0)
        return {"logprobs": logprobs, "entropy": entropy}
