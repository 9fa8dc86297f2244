"""Loading a model source's weights (``grpo_mega.checkpoint.source.ModelSource``) into an engine, by its kind.

Every engine's ``load_model_source`` comes here, so each kind of folder is read one way whichever engine takes it,
each through the engine's own loaders (``grpo_mega.engine.base.ForwardEngine``):

- an HF folder: its safetensors / .bin tensors, ``load_hf_weights``;
- a converted megatron folder: ``load_mcore_model``;
- a training checkpoint of the DeepSpeed engine: its ZeRO partitions merged to HF-named fp32 tensors
  (``engine.deepspeed_checkpoint``), ``load_hf_weights``;
- a training checkpoint of the Megatron engine: the model keys of ``model_sharded_state_dict`` read with
  dist_checkpointing at this job's layout, ``load_model_state_dict``, then ``reload_after_weight_load``; a LoRA
  run's checkpoint (adapters only): its base, then the adapters merged in (:func:`load_merged_lora_checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch

from grpo_mega.checkpoint.training_files import lora_settings


def source_hf_weights(source):
    """The HF-named tensors of an HF folder or of a DeepSpeed-engine checkpoint (a lazy mapping for a folder)."""
    if source.kind == "hf":
        from grpo_mega.checkpoint.hf_io import HFWeights

        return HFWeights(source.folder)
    return deepspeed_checkpoint_weights(source.folder)


def holds_hf_weights(source) -> bool:
    """Whether the source's weights are HF-named tensors (an HF folder, a DeepSpeed-engine checkpoint)."""
    return source.kind == "hf" or source.saved_by == "deepspeed"


def load_source_weights(engine, source) -> None:
    """Load the whole model of ``source`` into ``engine`` (or anything with its weight loaders); collective."""
    if holds_hf_weights(source):
        engine.load_hf_weights(source_hf_weights(source))
    elif source.kind == "mcore_model":
        engine.load_mcore_model(str(source.folder))
    else:
        from grpo_mega.checkpoint.weights_only import read_checkpoint_model

        lora = lora_settings(source.folder)
        if lora is not None:  # a LoRA run's checkpoint: its base with the adapters merged in (Megatron engines)
            if not hasattr(engine, "stage"):
                raise ValueError(f"{source.folder} holds LoRA adapters only: load it with engine=megatron, or "
                                 "export merged weights first (tools/convert_mcore_to_hf.py)")
            load_merged_lora_checkpoint(engine.stage, source.folder, lora)
        else:
            engine.load_model_state_dict(read_checkpoint_model(engine.model_sharded_state_dict(), source.folder))
        engine.reload_after_weight_load()  # fp32 master copies (bf16) follow the loaded weights


# A LoRA run's checkpoint read as whole weights: its base (the run's ``model.init_from``, named in the checkpoint's
# ``grpo_mega_checkpoint.json``) with its adapters merged in, W + (alpha / rank) B A: how such a checkpoint is a model
# source anywhere a whole model is wanted (``model.init_from``, ``grpo-mega eval --policy``,
# ``tools/convert_mcore_to_hf.py``).

def load_merged_lora_checkpoint(stage: torch.nn.Module, folder: str | os.PathLike, settings: dict) -> None:
    """Load the LoRA checkpoint ``folder`` (``settings``: its :func:`lora_settings`) into the megatron ``stage``
    (a whole model, no adapters of its own) at this job's layout: its base, then its adapters merged in; collective.
    ValueError naming the folder when the base cannot be found."""
    from grpo_mega.checkpoint.source import resolve_model_source

    base = settings.get("base")
    if not base:
        raise ValueError(f"{folder} holds LoRA adapters whose base is not recorded (model.init_from was not set)")
    try:
        source = resolve_model_source(base)
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"{folder} holds LoRA adapters only; their base {base} (model.init_from of the run) cannot "
                         f"be read: {error}") from error
    load_stage_weights(stage, source)
    read_lora_adapters(stage, folder, settings).merge_into_base()


def read_lora_adapters(stage: torch.nn.Module, folder: str | os.PathLike, settings: dict):
    """The adapters of the LoRA checkpoint ``folder`` for the megatron ``stage`` at this job's layout, read but
    not attached (``grpo_mega.lora.StageAdapters`` with ``attach=False``: to merge or export); collective."""
    from grpo_mega.checkpoint.weights_only import read_checkpoint_model
    from grpo_mega.lora.stage import StageAdapters

    # the adapters' saved settings, in the shape of model.lora (dropout plays no part in a merge)
    lora = SimpleNamespace(rank=int(settings["rank"]), alpha=float(settings["alpha"]), dropout=0.0, enabled=True,
                           target_modules=list(settings["target_modules"]))
    # a PRM's head trained beside the adapters is read with them (load_state_dict copies it into the stage)
    adapters = StageAdapters(stage, lora, seed=0, attach=False,
                             trained_modules=tuple(settings.get("trained_modules", ())))
    adapters.load_state_dict(read_checkpoint_model(adapters.sharded_state_dict(), folder))
    return adapters


def load_stage_weights(stage: torch.nn.Module, source) -> None:
    """The whole model of ``source`` (a ``ModelSource`` of any kind) into a bare megatron stage; collective. A
    classifier PRM's stage (no LM output layer) takes a causal LM's backbone (a LoRA PRM's base is the policy):
    the LM head is not read and the stage's head keeps its values."""
    if holds_hf_weights(source):
        from grpo_mega.checkpoint.hf_convert import load_hf_weights

        load_hf_weights(stage, source_hf_weights(source), source.hf_config,
                        skip_lm_output=_backbone_only(stage, source))
    elif source.kind == "mcore_model":
        from grpo_mega.checkpoint.mcore_checkpoint import load_mcore_checkpoint

        load_mcore_checkpoint(stage, source.folder)  # reads the tensors its table covers: a policy's has no head
    elif lora_settings(source.folder) is not None:  # a base that is itself a LoRA run's checkpoint
        load_merged_lora_checkpoint(stage, source.folder, lora_settings(source.folder))
    elif _backbone_only(stage, source):  # a policy's whole-model checkpoint: every tensor but the head's
        from grpo_mega.checkpoint.weights_only import read_checkpoint_model

        wanted = {name: value for name, value in stage.sharded_state_dict().items() if not name.startswith("head.")}
        missing, unexpected = stage.load_state_dict(read_checkpoint_model(wanted, source.folder), strict=False)
        missing = [name for name in missing if not name.startswith("head.")]
        if missing or unexpected:
            raise ValueError(f"{source.folder}: model tensors missing {missing[:8]}, unexpected {unexpected[:8]}")
    else:
        from grpo_mega.checkpoint.weights_only import load_model_state

        load_model_state(stage, source.folder)


def _backbone_only(stage: torch.nn.Module, source) -> bool:
    """Whether ``stage`` has no LM output layer (a classifier PRM) while ``source`` is a causal LM's weights."""
    from grpo_mega.checkpoint.hf_convert import _unwrap
    from grpo_mega.checkpoint.hf_layouts import architecture_for

    return (not _unwrap(stage).lm_output and source.hf_config is not None
            and architecture_for(source.hf_config).lm_output)


def deepspeed_checkpoint_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full fp32 model weights of a DeepSpeed-engine checkpoint folder, by Hugging Face name (DeepSpeed's
    ``zero_to_fp32`` merges the ZeRO partitions; any stage). Runs in one process, no job needed; in a job every
    rank calls it (a LoRA run's base is resolved by rank 0 for all)."""
    from grpo_mega.engine.deepspeed_checkpoint import saved_deepspeed_weights

    lora = lora_settings(folder)
    weights = saved_deepspeed_weights(folder)
    return weights if lora is None else _merged_with_base(weights, lora, folder)


def _merged_with_base(adapters: dict[str, torch.Tensor], lora: dict, folder) -> dict[str, torch.Tensor]:
    """A LoRA run's checkpoint (peft's adapters alone) as whole weights: its base (``lora["base"]``, the run's
    ``model.init_from``) with W + (alpha / rank) B A for every adapted linear, in fp32."""
    from grpo_mega.checkpoint.source import resolve_model_source

    if not lora.get("base"):
        raise ValueError(f"{folder} holds LoRA adapters without a base (no lora.base in its grpo_mega_checkpoint.json)")
    source = resolve_model_source(lora["base"])
    if not holds_hf_weights(source):
        raise ValueError(f"{folder}: its LoRA base {lora['base']} is not an HF folder or DeepSpeed checkpoint: "
                         "convert it to an HF folder first (tools/convert_mcore_to_hf.py)")
    from grpo_mega.engine.deepspeed_lora import merged_with_base

    return merged_with_base(source_hf_weights(source), adapters, float(lora["alpha"]) / int(lora["rank"]))
