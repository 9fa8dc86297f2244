"""A LoRA run's checkpoint read as whole weights: its base (the run's ``model.init_from``, named in the checkpoint's
``grpo_mega_checkpoint.json``) with its adapters merged in, W + (alpha / rank) B A. This is how such a checkpoint is
a model source anywhere a whole model is wanted: ``model.init_from`` of a new run, ``grpo-mega eval --policy``,
``tools/convert_mcore_to_hf.py`` (an HF folder of merged weights)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def lora_settings(folder: str | os.PathLike) -> dict | None:
    """The ``lora`` entry of a training checkpoint's info (rank, alpha, target_modules, base), or None when the
    checkpoint holds a whole model."""
    from grpo_mega.checkpoint.training_files import read_checkpoint_state

    return read_checkpoint_state(Path(folder)).get("lora")


def load_merged_lora_checkpoint(stage: torch.nn.Module, folder: str | os.PathLike, settings: dict) -> None:
    """Load the LoRA checkpoint ``folder`` (``settings``: its :func:`lora_settings`) into the megatron ``stage``
    (a whole model, no adapters of its own) at this job's layout: its base, then its adapters merged in; collective.
    ValueError naming the folder when the base cannot be found."""
    from grpo_mega.checkpoint.source import resolve_model_source
    from grpo_mega.checkpoint.weights_only import read_checkpoint_model
    from grpo_mega.config.lora import LoRAConfig
    from grpo_mega.lora.stage import StageAdapters

    base = settings.get("base")
    if not base:
        raise ValueError(f"{folder} holds LoRA adapters whose base is not recorded (model.init_from was not set)")
    try:
        source = resolve_model_source(base)
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"{folder} holds LoRA adapters only; their base {base} (model.init_from of the run) cannot "
                         f"be read: {error}") from error
    load_stage_weights(stage, source)
    lora = LoRAConfig(rank=int(settings["rank"]), alpha=float(settings["alpha"]),
                      target_modules=list(settings["target_modules"]))
    adapters = StageAdapters(stage, lora, seed=0, attach=False)
    adapters.load_state_dict(read_checkpoint_model(adapters.sharded_state_dict(), folder))
    adapters.merge_into_base()


def load_stage_weights(stage: torch.nn.Module, source) -> None:
    """The whole model of ``source`` (a ``ModelSource`` of any kind) into a bare megatron stage; collective."""
    from grpo_mega.engine.source_weights import holds_hf_weights, source_hf_weights

    if holds_hf_weights(source):
        from grpo_mega.checkpoint.hf_convert import load_hf_weights

        load_hf_weights(stage, source_hf_weights(source), source.hf_config)
    elif source.kind == "mcore_model":
        from grpo_mega.checkpoint.mcore_checkpoint import load_mcore_checkpoint

        load_mcore_checkpoint(stage, source.folder)
    else:
        from grpo_mega.checkpoint.weights_only import load_model_state

        load_model_state(stage, source.folder)
