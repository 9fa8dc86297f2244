"""The KL reference of a LoRA policy: the policy's own model with its adapters off (the frozen base), so no second
model is held. Serves the reference's one call, ``forward_logprobs``, as a forward-only engine does."""

from __future__ import annotations

import torch


class AdaptersOffReference:
    """Forward passes of ``policy`` (a Megatron engine with ``policy.lora``) with every adapter left out: exactly
    the base model the adapters were attached to, at the policy's layout and micro-batching."""

    def __init__(self, policy):
        if policy.lora is None:
            raise ValueError("AdaptersOffReference needs a policy trained with LoRA (model.lora.rank > 0)")
        self.policy = policy

    def forward_logprobs(self, batch: dict[str, torch.Tensor],
                         loss_tokens_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The base model's per-token log-probs and entropies [B, L] (see the engine's ``forward_logprobs``)."""
        with self.policy.lora.disabled():
            return self.policy.forward_logprobs(batch, loss_tokens_only)
