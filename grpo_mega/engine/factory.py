"""Build engines from an HF config: the policy (GPT backbone + LM head, trained), the KL reference (the same
model, forward only); other heads plug in the same way."""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core import parallel_state as mpu

from grpo_mega.engine.megatron_engine import MegatronEngine
from grpo_mega.engine.megatron_base import MegatronForwardEngine, StageModelProvider
from grpo_mega.model import LMHead, build_gpt_model, gpt_config_from_hf
from grpo_mega.model.gpt import local_layer_spec
from grpo_mega.parallel import get_device


def stage_provider(
    hf_config: Any,
    head_factory: Callable[[], torch.nn.Module],
    dtype: torch.dtype | None = None,
    *,
    lm_output: bool = True,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    routing_replay: bool = False,
    local_layers: bool = False,
) -> StageModelProvider:
    """``provider(pre_process, post_process)`` of a GPT backbone from ``hf_config`` with ``head_factory()`` on
    the last stage, at megatron's current TP / PP (``grpo_mega.parallel.init_distributed``). ``dtype`` None:
    fp32 on the CPU, the model config's default (bf16) on a GPU. ``lm_output=False``: the backbone has no LM
    output layer (a classifier PRM, whose head works from the hidden states alone). ``sequence_parallel``
    (``parallel.sequence_parallel``): None is on whenever TP > 1; ``recompute``: ``parallel.recompute``
    (``grpo_mega.model.config_map.RECOMPUTE_SETTINGS``); ``routing_replay``: the MoE routers replay the rollout's
    experts (``rollout.routing_replay``; megatron's ``moe_enable_routing_replay``,
    ``grpo_mega.engine.routing_replay``); ``local_layers``: megatron-core's local layers also where Transformer
    Engine's would run (LoRA adapts megatron-core's parallel linears, not TE's fused norm + linear)."""
    if dtype is None and get_device().type == "cpu":
        dtype = torch.float32
    tp = mpu.get_tensor_model_parallel_world_size()
    gpt_config = gpt_config_from_hf(
        hf_config,
        tp=tp,
        pp=mpu.get_pipeline_model_parallel_world_size(),
        dtype=dtype,
        sequence_parallel=resolve_sequence_parallel(sequence_parallel, tp),
        recompute=recompute,
        ep=mpu.get_expert_model_parallel_world_size(),
        overrides={"moe_enable_routing_replay": True} if routing_replay else None,
    )
    if routing_replay and not gpt_config.transformer.num_moe_experts:
        raise ValueError(f"routing replay is for mixture-of-experts models; {hf_config.model_type} has no experts")

    def provider(pre_process: bool, post_process: bool) -> torch.nn.Module:
        backbone = build_gpt_model(gpt_config, pre_process=pre_process, post_process=post_process,
                                   lm_output=lm_output,
                                   layer_spec=local_layer_spec(gpt_config.transformer) if local_layers else None)
        if post_process:
            backbone.head = head_factory()
        return backbone

    return provider


def resolve_sequence_parallel(setting: bool | None, tp: int) -> bool:
    """``parallel.sequence_parallel`` at tensor-parallel size ``tp``: None (auto) is on whenever TP > 1; true at
    TP=1 is an error (there is no TP group to split the sequence over)."""
    if setting is None:
        return tp > 1
    if setting and tp < 2:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tensor > 1: set it to null (auto) or false")
    return bool(setting)


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
    lm_output: bool = True,
    share_prompt_prefix: bool = False,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    distributed_optimizer: bool = True,
    routing_replay: bool = False,
    attach_adapters=None,
) -> MegatronEngine:
    """A training :class:`MegatronEngine` over a GPT backbone from ``hf_config`` with ``head_factory()`` on the
    last stage; ``total_steps`` is the length of the learning-rate schedule in trainer steps; ``lm_output`` as
    in :func:`stage_provider`, and ``sequence_parallel``, ``recompute``; ``distributed_optimizer``:
    ``parallel.distributed_optimizer``; ``routing_replay`` as in :func:`stage_provider`; ``attach_adapters``:
    LoRA (``grpo_mega.lora.lora_attacher``; the stage then uses megatron's local layers, whose linears it adapts)."""
    return MegatronEngine(
        stage_provider(hf_config, head_factory, dtype, lm_output=lm_output, sequence_parallel=sequence_parallel,
                       recompute=recompute, routing_replay=routing_replay,
                       local_layers=attach_adapters is not None),
        optim=optim,
        total_steps=total_steps,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        output_names=output_names,
        next_token_head=next_token_head,
        hf_config=hf_config,
        share_prompt_prefix=share_prompt_prefix,
        distributed_optimizer=distributed_optimizer,
        attach_adapters=attach_adapters,
    )


def build_forward_engine(
    hf_config: Any,
    head_factory: Callable[[], torch.nn.Module],
    *,
    output_names: tuple[str, ...],
    next_token_head: bool,
    max_tokens_per_micro_batch: int,
    dtype: torch.dtype | None = None,
    lm_output: bool = True,
    share_prompt_prefix: bool = False,
    sequence_parallel: bool | None = None,
) -> MegatronForwardEngine:
    """A forward-only :class:`MegatronForwardEngine` (no optimizer, no gradients) of the same model. It never runs
    a backward pass, so it takes no ``recompute``."""
    return MegatronForwardEngine(
        stage_provider(hf_config, head_factory, dtype, lm_output=lm_output, sequence_parallel=sequence_parallel),
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        output_names=output_names,
        next_token_head=next_token_head,
        hf_config=hf_config,
        share_prompt_prefix=share_prompt_prefix,
    )


def _lm_head(logprob_chunk_size: int, temperature: float, logits_in_fp32: bool) -> Callable[[], torch.nn.Module]:
    return lambda: LMHead(chunk_size=logprob_chunk_size, temperature=temperature, logits_in_fp32=logits_in_fp32)


def build_policy_engine(
    hf_config: Any,
    *,
    optim,
    total_steps: int,
    max_tokens_per_micro_batch: int,
    logprob_chunk_size: int = 1024,
    temperature: float = 1.0,
    logits_in_fp32: bool = True,
    dtype: torch.dtype | None = None,
    engine_kind: str = "megatron",
    deepspeed=None,
    share_prompt_prefix: bool = False,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    distributed_optimizer: bool = True,
    routing_replay: bool = False,
    attach_adapters=None,
) -> MegatronEngine:
    """The policy: GPT backbone + :class:`~grpo_mega.model.LMHead` (log-probs and entropies of the tokens,
    computed with ``logits / temperature`` so they match the sampler; ``logits_in_fp32``: the head's logits in
    fp32 also when the model is bf16, ``model.logits_in_fp32``). ``share_prompt_prefix``: rows sharing a prompt
    carry one copy of it through the layers (``parallel.share_prompt_prefix``; Megatron engine only, exact).
    ``distributed_optimizer``: shard optimizer state over DP ranks (``parallel.distributed_optimizer``; Megatron).
    ``sequence_parallel`` and ``recompute``: ``parallel.sequence_parallel`` / ``parallel.recompute`` (Megatron
    engine only). ``routing_replay``: its MoE routers replay the rollout's experts from the batch's ``routed_experts``
    (``rollout.routing_replay``; Megatron engine only; the KL reference never replays). ``engine_kind="deepspeed"``:
    the HF model on a
    :class:`~grpo_mega.engine.deepspeed_engine.DeepSpeedEngine` with ``deepspeed`` (``config.DeepSpeedConfig``).
    ``attach_adapters``: LoRA (``model.lora``, ``grpo_mega.lora.lora_attacher``): megatron's adapters on the
    Megatron engine, peft's on the DeepSpeed engine's HF model (``engine.deepspeed_lora``)."""
    if engine_kind == "deepspeed":
        _check_megatron_only(sequence_parallel, recompute)
        if routing_replay:
            raise ValueError("rollout.routing_replay needs engine=megatron (megatron-core's router replay)")
        from grpo_mega.engine.deepspeed_engine import DeepSpeedEngine
        from grpo_mega.engine.hf_policy import build_hf_logprob_model

        module = build_hf_logprob_model(hf_config, chunk_size=logprob_chunk_size, temperature=temperature,
                                        logits_in_fp32=logits_in_fp32)
        return DeepSpeedEngine(module, hf_config=hf_config, settings=deepspeed, optim=optim, total_steps=total_steps,
                               max_tokens_per_micro_batch=max_tokens_per_micro_batch, lora=attach_adapters)
    _check_engine_kind(engine_kind)
    return build_engine(
        hf_config,
        _lm_head(logprob_chunk_size, temperature, logits_in_fp32),
        output_names=("logprobs", "entropy"),
        next_token_head=True,
        optim=optim,
        total_steps=total_steps,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        dtype=dtype,
        share_prompt_prefix=share_prompt_prefix,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        distributed_optimizer=distributed_optimizer,
        routing_replay=routing_replay,
        attach_adapters=attach_adapters,
    )


def build_reference_engine(
    hf_config: Any,
    *,
    max_tokens_per_micro_batch: int,
    logprob_chunk_size: int = 1024,
    temperature: float = 1.0,
    logits_in_fp32: bool = True,
    dtype: torch.dtype | None = None,
    engine_kind: str = "megatron",
    deepspeed=None,
    share_prompt_prefix: bool = False,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
) -> MegatronForwardEngine:
    """The KL reference: the policy's model and LM head on a forward-only engine (no optimizer, no DDP gradient
    buffers, no gradients); load its weights with ``grpo_mega.checkpoint.initial_weights.load_initial_weights``.
    ``sequence_parallel`` as the policy's; ``recompute`` is accepted so that the policy's settings can be passed
    whole, and has no effect (no backward pass). ``engine_kind="deepspeed"``: a
    :class:`~grpo_mega.engine.deepspeed_engine.DeepSpeedForwardEngine`."""
    if engine_kind == "deepspeed":
        _check_megatron_only(sequence_parallel, recompute)
        from grpo_mega.engine.deepspeed_engine import DeepSpeedForwardEngine
        from grpo_mega.engine.hf_policy import build_hf_logprob_model

        module = build_hf_logprob_model(hf_config, chunk_size=logprob_chunk_size, temperature=temperature,
                                        logits_in_fp32=logits_in_fp32)
        return DeepSpeedForwardEngine(module, hf_config=hf_config, settings=deepspeed,
                                      max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    _check_engine_kind(engine_kind)
    return build_forward_engine(
        hf_config,
        _lm_head(logprob_chunk_size, temperature, logits_in_fp32),
        output_names=("logprobs", "entropy"),
        next_token_head=True,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        dtype=dtype,
        share_prompt_prefix=share_prompt_prefix,
        sequence_parallel=sequence_parallel,
    )


def _check_megatron_only(sequence_parallel: bool | None, recompute: str) -> None:
    """Sequence parallelism and recompute are megatron-core features: the DeepSpeed engine (ZeRO on the HF model,
    no TP) has neither."""
    if sequence_parallel:
        raise ValueError("parallel.sequence_parallel needs engine=megatron with parallel.tensor > 1")
    if recompute != "none":
        raise ValueError(f"parallel.recompute={recompute!r} needs engine=megatron: set parallel.recompute=none")


def _check_engine_kind(engine_kind: str) -> None:
    if engine_kind != "megatron":
        raise ValueError(f"engine={engine_kind!r}: expected 'megatron' or 'deepspeed'")
