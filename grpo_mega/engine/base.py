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
``sum(x * mask) / scale.global_tokens``); a metric whose name ends in ``_max`` is reduced by max instead.
"""


class NonFiniteError(RuntimeError):
    """A training step whose loss or global gradient norm is NaN or Inf; raised on every rank.

    The update was not applied: parameters, optimizer state and the optimizer-step count are as before the step,
    and the gradients are zeroed. The message gives the loss and the gradient norm (the trainer adds the step).
    """

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(
            f"non-finite training step: loss {loss!r}, grad norm {grad_norm!r}; the update was not applied "
            "(parameters and optimizer state unchanged)"
        )
        self.loss = loss
        self.grad_norm = grad_norm


class ForwardEngine(Protocol):
    """A model that only runs forward (the KL reference, a PRM at scoring time): no optimizer, no gradients.

    Batches may have any number of rows >= 1, also fewer than the data-parallel ranks.
    """

    hf_config: object
    """The Hugging Face config of the backbone."""

    def forward(self, batch: dict[str, torch.Tensor], loss_tokens_only: bool = False) -> dict[str, torch.Tensor]:
        """Head outputs for the whole batch (no gradient), on every rank: {name: [B, L]}. ``loss_tokens_only``: the
        caller reads a next-token head's outputs at ``batch["loss_mask"]``'s tokens only; elsewhere they may be 0."""

    def forward_logprobs(self, batch: dict[str, torch.Tensor],
                         loss_tokens_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities and entropies [B, L] of the tokens in ``input_ids`` (policy heads); see
        :meth:`forward` for ``loss_tokens_only``."""

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face-named tensors one at a time, gathered over TP / PP (collective: all ranks call)."""

    # Weights (collective; used by grpo_mega.checkpoint, which touches nothing else of an engine)
    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the model parameters (bf16 on GPU, fp32 on CPU)."""

    def model_sharded_state_dict(self) -> dict:
        """The model's megatron ``ShardedStateDict`` (global shapes: loadable at any TP / PP)."""

    def load_model_state_dict(self, state: dict) -> None:
        """Copy a loaded model state (``dist_checkpointing.load`` of ``model_sharded_state_dict()``) into the
        model. Training engines: follow with ``load_optimizer_state_dict`` or ``reload_after_weight_load``."""

    def load_hf_weights(self, hf_weights) -> None:
        """Copy Hugging Face-named weights (a mapping name -> full tensor) into the model, then
        ``reload_after_weight_load``."""

    def load_mcore_model(self, directory: str) -> None:
        """Load the backbone of a converted megatron model folder, then ``reload_after_weight_load``."""

    def load_model_source(self, source) -> None:
        """Load the weights of a ``grpo_mega.checkpoint.source.ModelSource`` (HF folder, converted folder, training
        checkpoint of either engine) with the loaders above (``grpo_mega.engine.source_weights``)."""

    def reload_after_weight_load(self) -> None:
        """Make everything derived from the weights follow them (bf16: the optimizer's fp32 master copies)."""


class TrainingEngine(ForwardEngine, Protocol):
    """What a trainer needs from an engine (Megatron today, DeepSpeed beside it later).

    The learning-rate schedule counts trainer steps, not optimizer steps: ``train_step`` applies one optimizer
    step at the current learning rate, and the trainer calls ``lr_schedule_step`` once per trainer step however
    many optimizer steps it took (mini-batches, epochs, dynamic sampling).
    """

    steps_done: int
    """Optimizer steps actually applied (saved in checkpoints)."""

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the whole batch at the current learning rate (the schedule does not move);
        returns summed metrics, ``loss``, ``grad_norm`` (before clipping) and ``lr``. Raises
        :class:`NonFiniteError` (on every rank, nothing applied) when the loss or the gradient norm is not finite."""

    def lr_schedule_step(self) -> None:
        """Advance the learning-rate schedule by one trainer step."""

    @property
    def current_lr(self) -> float:
        """The learning rate the next ``train_step`` uses."""

    # Checkpoints (collective)
    def optimizer_sharded_state_dict(self, model_sharded_state: dict, *, is_loading: bool) -> dict:
        """The optimizer's ``ShardedStateDict`` over ``model_sharded_state`` (the same call's model dict)."""

    def load_optimizer_state_dict(self, state: dict) -> list[str]:
        """Restore a loaded optimizer state (moments, step counts, fp32 master copies); its hyperparameters stay
        the engine's (the current config). Returns those that differ from the checkpoint's, ``"name old -> new"``."""

    def schedule_state_dict(self) -> dict:
        """The learning-rate schedule: its settings and position (``num_steps``, in trainer steps)."""

    def restore_schedule(self, saved: dict, *, position: int | None = None) -> list[str]:
        """Move the schedule to ``position`` (default ``saved["num_steps"]``), keeping the settings the engine
        was built with (the current config); returns the settings that differ from ``saved``, as
        ``"name old -> new"``."""
