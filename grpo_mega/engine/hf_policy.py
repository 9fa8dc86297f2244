"""A Hugging Face causal LM shaped for the DeepSpeed engine: the backbone and a log-prob head as one module.

:class:`HFTokenLogprobModel` holds ``model`` (the transformers backbone, e.g. ``Qwen2Model``) and ``lm_head``
(:class:`LogprobLMHead`, owning the HF output matrix), so its parameter names are the Hugging Face checkpoint
names (``model.layers.0...``, ``lm_head.weight``; with tied embeddings only ``model.embed_tokens.weight``).
Its forward returns per-token log-probs and entropies instead of logits: the head computes them with the same
chunked function as the Megatron engine's ``LMHead`` (``grpo_mega.model.logprobs``, at TP = 1), so both engines
agree to rounding, and no ``[tokens, vocab]`` logits are kept for backward.

The log-prob computation lives inside ``lm_head``'s own ``forward`` on purpose: ZeRO-3 gathers a module's
parameters in its forward and backward hooks, so the output matrix is only complete inside that call.
"""

from __future__ import annotations

import torch

from grpo_mega.engine.megatron_base import align_to_tokens
from grpo_mega.model.heads import next_token_labels
from grpo_mega.model.logprobs import vocab_parallel_logprobs_and_entropy


class LogprobLMHead(torch.nn.Module):
    """The HF output matrix ``weight`` [V, H] as a head: ``forward(hidden [B, S, H], labels [B, S])`` gives
    fp32 (log p(label), entropy) [B, S] of ``hidden W^T / temperature`` (see ``vocab_parallel_logprobs_and_entropy``;
    the tensor-parallel group is megatron's, of size 1 under the DeepSpeed engine)."""

    def __init__(self, weight: torch.nn.Parameter, *, chunk_size: int, temperature: float, logits_in_fp32: bool):
        super().__init__()
        self.weight = weight  # the same Parameter object: a tie to the embedding survives
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.logits_in_fp32 = logits_in_fp32

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logprobs_and_entropy(
            hidden, self.weight, labels, vocab_size=self.weight.shape[0], chunk_size=self.chunk_size,
            temperature=self.temperature, logits_in_fp32=self.logits_in_fp32,
        )


class HFTokenLogprobModel(torch.nn.Module):
    """``model`` + ``lm_head`` of a transformers causal LM; ``forward(input_ids)`` gives {"logprobs", "entropy"}
    [B, S] in the engines' alignment: ``logprobs[:, t] = log p(input_ids[:, t] | tokens < t)``, 0 at t = 0.

    Rows are right-padded and attention is causal only (no padding mask), as in the Megatron engine: a real
    token never attends to padding, and outputs at padding positions are ignored by the losses.
    """

    output_names = ("logprobs", "entropy")

    def __init__(self, causal_lm: torch.nn.Module, *, chunk_size: int, temperature: float, logits_in_fp32: bool):
        super().__init__()
        self.config = causal_lm.config
        self.model = causal_lm.model
        self.lm_head = LogprobLMHead(causal_lm.lm_head.weight, chunk_size=chunk_size, temperature=temperature,
                                     logits_in_fp32=logits_in_fp32)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        logprobs, entropy = self.lm_head(hidden, next_token_labels(input_ids))
        # Position t is about token t + 1 (the last has no next token): shift so position t is about token t.
        logprobs = torch.nn.functional.pad(logprobs[:, :-1], (0, 1), value=0.0)
        return {"logprobs": align_to_tokens(logprobs), "entropy": align_to_tokens(entropy)}


def build_hf_logprob_model(
    hf_config, *, chunk_size: int = 1024, temperature: float = 1.0, logits_in_fp32: bool = True,
    dtype: torch.dtype = torch.float32,
) -> HFTokenLogprobModel:
    """A randomly initialised :class:`HFTokenLogprobModel` of ``hf_config`` (any transformers causal LM whose
    ``model`` returns final-normed hidden states and whose ``lm_head`` is a bias-free Linear: Qwen2, Llama)."""
    from transformers import AutoModelForCausalLM

    causal_lm = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if getattr(causal_lm.lm_head, "bias", None) is not None:
        raise ValueError(f"{type(causal_lm).__name__}: an lm_head with a bias is not supported by the DeepSpeed engine")
    return HFTokenLogprobModel(causal_lm, chunk_size=chunk_size, temperature=temperature,
                               logits_in_fp32=logits_in_fp32)
