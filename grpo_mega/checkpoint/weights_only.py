"""The model weights of a training checkpoint alone: optimizer, schedule, RNG and step stay out.

For a new run started from a checkpoint (``model.init_from``), a PRM opened for scoring, and the conversion tools.
Which folder a path means is ``grpo_mega.checkpoint.source``; the engines read a checkpoint's model through
:func:`read_checkpoint_model` (Megatron files) from their ``load_model_source``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from grpo_mega.checkpoint.extra_state import load_sharded
from grpo_mega.checkpoint.source import locate_checkpoint, resolve_model_source


def read_checkpoint_model(model_sharded_state: dict, folder: str | os.PathLike) -> dict:
    """The model tensors of the (Megatron-engine) checkpoint ``folder`` for the keys of ``model_sharded_state`` (a
    model's ``sharded_state_dict()``, or part of it), at this job's layout; collective. The checkpoint's other
    entries stay on disk."""
    return load_sharded({"model": model_sharded_state}, folder)["model"]


def load_model_state(model: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Load the model weights of a training checkpoint (or a run directory's newest) into a built model of this
    job's layout; collective. Returns the folder loaded. (A LoRA run's checkpoint holds adapters only: the engines
    read it through ``grpo_mega.engine.source_weights``, its base with the adapters merged in.)"""
    folder = locate_checkpoint(path)
    model.load_state_dict(read_checkpoint_model(model.sharded_state_dict(), folder))
    return folder


def load_model_only(engine, path: str | os.PathLike) -> Path:
    """Load only the model weights of a training checkpoint (``model.init_from``), at any layout; collective.

    ``path`` is a checkpoint folder or a run directory (its newest complete checkpoint is used), of either engine.
    Optimizer, schedule, RNG and step stay as they are: a new run starts from these weights. Works on training and
    forward-only engines (``engine.load_model_source``). Returns the folder loaded. Raises ValueError when there is
    no complete checkpoint there.
    """
    source = resolve_model_source(path)
    if not source.is_checkpoint:
        raise ValueError(f"{path} is not a complete training checkpoint: it is a {source.kind} folder")
    engine.load_model_source(source)
    return source.folder
