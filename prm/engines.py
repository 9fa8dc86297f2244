"""The PRM on the training engines: a training or forward-only engine of a :class:`~prm.spec.PRMSpec`.

``engine_kind`` chooses the engine: ``megatron`` (a GPT backbone with the ``prm.heads`` head; TP / PP / DP) or
``deepspeed`` (the transformers model of ``prm.hf_model`` under ZeRO; data parallel only). In the ``classifier``
and ``lm_tokens`` layouts a step is scored at the last token of its step tag, from that token's own hidden state;
the engines' outputs are ``good_logprob`` / ``bad_logprob`` per token (score = ``exp(good_logprob)``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from grpo_mega.checkpoint.hf_layouts import architecture_for
from prm.heads import OUTPUT_NAMES, ClassifierHead, LabelTokenHead, StepLikelihoodHead
from prm.spec import PRMSpec, config_field, layout_and_label_ids


def _head_of(hf_config: Any, spec: PRMSpec, tokenizer: Any) -> tuple[Callable[[], torch.nn.Module], bool]:
    """(head factory, whether the backbone has an LM output layer) of ``spec`` on the Megatron model of
    ``hf_config``."""
    layout, label_ids = layout_and_label_ids(hf_config, spec, tokenizer)
    if layout == "classifier":
        hidden_size = int(config_field(hf_config, "hidden_size"))
        return (lambda: ClassifierHead(hidden_size)), False
    if layout == "likelihood":
        return StepLikelihoodHead, True
    return (lambda: LabelTokenHead(*label_ids)), True


def _deepspeed_prm_engine(hf_config: Any, spec: PRMSpec, tokenizer: Any, *, deepspeed, train: bool, **engine_args):
    """The PRM's transformers model (``prm.hf_model``) on a DeepSpeed engine (training or forward-only)."""
    from grpo_mega.engine.deepspeed_engine import DeepSpeedEngine, DeepSpeedForwardEngine
    from prm.hf_model import build_hf_prm

    if deepspeed is None:
        raise ValueError("engine_kind='deepspeed' needs the deepspeed settings (grpo_mega.config.DeepSpeedConfig)")
    if spec.layout == "likelihood":
        raise ValueError("prm.layout=likelihood runs on the megatron engine (engine=megatron); the deepspeed PRM "
                         "engine has the classifier and lm_tokens layouts")
    module = build_hf_prm(hf_config, *layout_and_label_ids(hf_config, spec, tokenizer))
    engine_class = DeepSpeedEngine if train else DeepSpeedForwardEngine
    return engine_class(module, hf_config=hf_config, settings=deepspeed, megatron_stage=build_conversion_stage,
                        **engine_args)


def _check_engine_kind(engine_kind: str) -> None:
    if engine_kind not in ("megatron", "deepspeed"):
        raise ValueError(f"engine={engine_kind!r}: expected 'megatron' or 'deepspeed'")


def build_prm_engine(
    hf_config: Any,
    spec: PRMSpec,
    tokenizer: Any,
    *,
    optim,
    total_steps: int,
    max_tokens_per_micro_batch: int,
    dtype: torch.dtype | None = None,
    engine_kind: str = "megatron",
    deepspeed=None,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    distributed_optimizer: bool = True,
    attach_adapters=None,
):
    """A training engine of the PRM (outputs ``good_logprob``, ``bad_logprob`` per token, not shifted): a
    :class:`~grpo_mega.engine.MegatronEngine` at megatron's current TP / PP / DP (``sequence_parallel``,
    ``recompute``: ``parallel.sequence_parallel`` / ``parallel.recompute``; ``distributed_optimizer``:
    ``parallel.distributed_optimizer``), or with ``engine_kind="deepspeed"``
    a :class:`~grpo_mega.engine.deepspeed_engine.DeepSpeedEngine` with ``deepspeed`` (``config.DeepSpeedConfig``).
    ``attach_adapters``: LoRA (``model.lora``, ``grpo_mega.lora.lora_attacher`` with ``trained_modules=("head",)``:
    the classifier head trained whole beside the adapters); Megatron engine only.
    Raises ValueError when ``spec.layout`` is not the layout of ``hf_config`` or (``lm_tokens``) a label token is
    not one token of ``tokenizer``."""
    from grpo_mega.engine.factory import build_engine

    _check_engine_kind(engine_kind)
    if engine_kind == "deepspeed":
        if attach_adapters is not None:
            raise ValueError("model.lora needs engine=megatron (the DeepSpeed engine has no LoRA yet)")
        if sequence_parallel or recompute != "none":
            raise ValueError("parallel.sequence_parallel and parallel.recompute need engine=megatron")
        return _deepspeed_prm_engine(hf_config, spec, tokenizer, deepspeed=deepspeed, train=True, optim=optim,
                                     total_steps=total_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    head_factory, lm_output = _head_of(hf_config, spec, tokenizer)
    return build_engine(
        hf_config, head_factory, output_names=OUTPUT_NAMES, next_token_head=False, optim=optim,
        total_steps=total_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch, dtype=dtype,
        lm_output=lm_output, sequence_parallel=sequence_parallel, recompute=recompute,
        distributed_optimizer=distributed_optimizer, attach_adapters=attach_adapters,
    )


def build_prm_forward_engine(
    hf_config: Any,
    spec: PRMSpec,
    tokenizer: Any,
    *,
    max_tokens_per_micro_batch: int,
    dtype: torch.dtype | None = None,
    engine_kind: str = "megatron",
    deepspeed=None,
    sequence_parallel: bool | None = None,
    share_prompt_prefix: bool = True,
):
    """The same model on a forward-only engine (scoring): a :class:`~grpo_mega.engine.MegatronForwardEngine`
    (``sequence_parallel``: ``parallel.sequence_parallel``, None = on whenever TP > 1; ``share_prompt_prefix``:
    rows of a batch with ``prompt_lengths`` that share a prompt carry one copy of it through the layers,
    ``grpo_mega.engine.shared_prefix``, exact), or a
    :class:`~grpo_mega.engine.deepspeed_engine.DeepSpeedForwardEngine` with ``engine_kind="deepspeed"``."""
    from grpo_mega.engine.factory import build_forward_engine

    _check_engine_kind(engine_kind)
    if engine_kind == "deepspeed":
        return _deepspeed_prm_engine(hf_config, spec, tokenizer, deepspeed=deepspeed, train=False,
                                     max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    head_factory, lm_output = _head_of(hf_config, spec, tokenizer)
    return build_forward_engine(
        hf_config, head_factory, output_names=OUTPUT_NAMES, next_token_head=False,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch, dtype=dtype, lm_output=lm_output,
        sequence_parallel=sequence_parallel, share_prompt_prefix=share_prompt_prefix,
    )


def build_conversion_stage(hf_config: Any, gpt_config, *, local_layers: bool = False) -> torch.nn.Module:
    """This rank's stage of whatever model an HF folder of ``hf_config`` holds, for the conversion tools: a causal
    LM's backbone, or a classifier PRM's backbone (no LM output layer) with its head on the last stage.
    ``local_layers``: megatron-core's local layers also where Transformer Engine's would run (a LoRA checkpoint's
    adapters are read onto those)."""
    from grpo_mega.model import build_gpt_model
    from grpo_mega.model.gpt import local_layer_spec

    table = architecture_for(hf_config)
    model = build_gpt_model(gpt_config, lm_output=table.lm_output,
                            layer_spec=local_layer_spec(gpt_config.transformer) if local_layers else None)
    if not table.lm_output and model.post_process:
        model.head = ClassifierHead(int(hf_config.hidden_size))
    return model
