"""The one interface the trainers (GRPO, SFT, PRM) use to drive a training engine.

Batches are dicts of CPU or device tensors, identical on every rank of the job (token ids are small; every rank
holding the whole batch keeps the trainer SPMD and the engine free to shard rows over data-parallel ranks):

- ``input_ids`` [B, L] long, each row ``prompt + response`` right-padded;
- ``attention_mask`` [B, L], 1 on real tokens (rows are right-padded, so causal attention never sees padding);
- any per-token field [B, L] aligned with ``input_ids``: the value at position t belongs to token t
  (e.g. ``loss_mask``, ``advantages``, ``old_logprobs``); per-row fields are [B] or [B, K].

A head's per-token outputs follow the same alignment: ``logprobs[b, t] = log p(input_ids[b, t] | tokens < t)``
(0 at t = 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch


@dataclass(frozen=True)
class LossScale:
    """Global normalisers of a training step, counted over the whole batch (all micro-batches, all DP ranks).

    A loss function returns its micro-batch's share of the global loss, e.g. ``sum(l * mask) / global_tokens``,
    so the step's loss and gradient do not depend on how the batch is split (see ``grpo_mega.algo.aggregate_loss``).
    """

    global_tokens: float
    """Tokens with ``loss_mask`` set."""
    global_seqs: float
    """Rows with at least one ``loss_mask`` token."""


LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossScale], tuple[torch.Tensor, dict]]
"""``loss_fn(head_outputs, micro_batch, scale) -> (loss share, {metric name: share of the global metric})``.

Metrics are summed over micro-batches and data-parallel ranks, so return shares too (e.g. a token mean as
``sum(x * mask) / scale.global_tokens``).
"""


class TrainingEngine(Protocol):
    """What a trainer needs from an engine (Megatron today, DeepSpeed beside it later)."""

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Head outputs for the whole batch (no gradient), on every rank: {name: [B, L]}."""

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities and entropies [B, L] of the tokens in ``input_ids`` (policy heads)."""

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the whole batch; returns summed metrics, ``grad_norm`` and ``lr``."""

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face-named tensors one at a time, gathered over TP / PP (collective: all ranks call)."""
