"""Build engines from an HF config: the policy (GPT backbone + LM head) today, other heads plug in the same way."""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core import parallel_state as mpu

from grpo_mega.engine.megatron_engine import MegatronEngine
from grpo_mega.model import LMHead, build_gpt_model, gpt_config_from_hf


def build_engine(
    hf_config: Any,
    head_factory: Callable[[], torch.nn.Module],
    *,
    output_names: tuple[str, ...],
    next_token_head: bool,
    optim,
    total_steps: int,
    max_tokens_per_micro_batch: int,
    dtype: torch.dtype | None = None,
) -> MegatronEngine:
    """A :class:`MegatronEngine` over a GPT backbone from ``hf_config`` with ``head_factory()`` on the last stage.

    The TP / PP sizes come from megatron's parallel state (``grpo_mega.parallel.init_distributed``).
    """
    gpt_config = gpt_config_from_hf(
        hf_config,
        tp=mpu.get_tensor_model_parallel_world_size(),
        pp=mpu.get_pipeline_model_parallel_world_size(),
        dtype=dtype,
    )

    def provider(pre_process: bool, post_process: bool) -> torch.nn.Module:
        backbone = build_gpt_model(gpt_config, pre_process=pre_process, post_process=post_process)
        if post_process:
            backbone.head = head_factory()
        return backbone

    return MegatronEngine(
        provider,
        optim=optim,
        total_steps=total_steps,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        output_names=output_names,
        next_token_head=next_token_head,
        hf_config=hf_config,
    )


def build_policy_engine(
    hf_config: Any,
    *,
    optim,
    total_steps: int,
    max_tokens_per_micro_batch: int,
    logprob_chunk_size: int = 1024,
    temperature: float = 1.0,
    dtype: torch.dtype | None = None,
) -> MegatronEngine:
    """The policy: GPT backbone + :class:`~grpo_mega.model.LMHead` (log-probs and entropies of the tokens,
    computed with ``logits / temperature`` so they match the sampler)."""
    return build_engine(
        hf_config,
        lambda: LMHead(chunk_size=logprob_chunk_size, temperature=temperature),
        output_names=("logprobs", "entropy"),
        next_token_head=True,
        optim=optim,
        total_steps=total_steps,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        dtype=dtype,
    )
