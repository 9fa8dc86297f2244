"""Where a model's weights come from: the path a user gives, resolved once into a :class:`ModelSource`.

A model is named by a path (``model.init_from``, ``process_reward.prm``, ``prm score --prm``, ``prm label
--policy``, the conversion tools), which is one of four kinds (``training_files.weights_format`` tells which; it is
called here only):

- ``hf``: a Hugging Face folder (config.json with *.safetensors or pytorch_model*.bin);
- ``mcore_model``: a converted megatron folder (``save_mcore_checkpoint``: grpo_mega_model.json, the HF config and
  tokenizer files in ``hf/``);
- ``training_checkpoint``: a grpo-mega training checkpoint, saved by the Megatron or the DeepSpeed engine;
- ``training_run``: a grpo-mega run directory, meaning its newest complete checkpoint.

:func:`resolve_model_source` reads, once, what every user of the model needs: the folder holding the weights, the
HF config, the folders of the HF config and the tokenizer, and for a checkpoint the run config it was trained with
(whose ``prm`` section holds a PRM's layout and rendering settings: ``prm.spec`` reads them). Loading the weights is
the engine's business, through its own interface: ``engine.load_model_source(source)`` (``grpo_mega.engine``), since
the engine knows its format; this layer never imports the engines.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo_mega.checkpoint.collective import rank0_decides
from grpo_mega.checkpoint.training_files import DEEPSPEED_METADATA, find_checkpoint_folder, weights_format
from grpo_mega.run.layout import CONFIG_FILE

logger = logging.getLogger(__name__)

CHECKPOINT_KINDS = ("training_checkpoint", "training_run")
"""The kinds that are grpo-mega training checkpoints (a run directory stands for its newest one)."""


@dataclass(frozen=True)
class ModelSource:
    """A model's weights and what describes them, resolved from a path (:func:`resolve_model_source`)."""

    path: Path
    """The path as the user gave it."""
    kind: str
    """``hf``, ``mcore_model``, ``training_checkpoint`` or ``training_run`` (module docstring)."""
    folder: Path
    """The folder holding the weights: ``path`` itself, or a run directory's newest complete checkpoint."""
    hf_config: Any | None
    """The model's transformers config; None for a checkpoint whose run config names no ``model.hf_config`` with a
    config.json."""
    hf_config_folder: Path | None
    """The folder of that config.json (``hf/`` of a converted folder; a checkpoint's ``model.hf_config``, None when
    its run config has none)."""
    tokenizer_folder: Path | None
    """Where the tokenizer is: the HF folder, ``hf/`` of a converted folder, a checkpoint's ``model.tokenizer`` (else
    its ``model.hf_config``); None when a checkpoint's run config names neither."""
    run_config: dict | None = None
    """A checkpoint's saved run config (``config.yaml``); None for an HF or converted folder."""
    saved_by: str | None = None
    """A checkpoint's engine: ``megatron`` or ``deepspeed`` (whose files are its own); None for the other kinds."""

    @property
    def is_checkpoint(self) -> bool:
        """Whether this is a grpo-mega training checkpoint (or a run directory's)."""
        return self.kind in CHECKPOINT_KINDS

    @property
    def model_settings(self) -> dict:
        """A checkpoint's ``model`` config section ({} for the other kinds)."""
        return dict((self.run_config or {}).get("model") or {})

    @property
    def trained_prm(self) -> dict:
        """The ``prm`` config section a grpo-mega PRM was trained with: its layout, tag, label tokens and rendering
        ({} for an HF or converted folder, and for a policy's checkpoint)."""
        return dict((self.run_config or {}).get("prm") or {})


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """:func:`find_checkpoint_folder`, decided by rank 0 for every rank (collective in a distributed job)."""
    return rank0_decides(lambda: find_checkpoint_folder(path))


def checkpoint_config(path: str | os.PathLike) -> dict:
    """The run config stored with a training checkpoint (or a run directory's newest checkpoint)."""
    return yaml.safe_load((locate_checkpoint(path) / CONFIG_FILE).read_text()) or {}


def resolve_model_source(path: str | os.PathLike | ModelSource) -> ModelSource:
    """The :class:`ModelSource` of ``path`` (a ``ModelSource`` is returned as it is). Rank 0 resolves and every
    rank gets its answer, or its error (collective in a distributed job, on every rank; any process otherwise).

    Raises ValueError naming the path when it is none of the four kinds (``init_from: <path> is none of: ...``),
    when a run directory holds no complete checkpoint, or when a checkpoint is incomplete.
    """
    if isinstance(path, ModelSource):
        return path
    return rank0_decides(lambda: _resolve(Path(path)))


def model_path_summary(path: str | os.PathLike) -> tuple[str, dict | None, dict | None]:
    """(kind, a checkpoint's run config or None, the model's config.json as a dict or None) of ``path``, read
    without transformers or torch (their import is most of a check before launch: :func:`resolve_model_source`
    reads the config through transformers). ValueError as :func:`resolve_model_source`'s."""
    import json

    path = Path(path)
    kind = weights_format(path)
    if kind in ("hf", "mcore_model"):
        config = path / ("hf" if kind == "mcore_model" else "") / "config.json"
        return kind, None, json.loads(config.read_text()) if config.is_file() else None
    folder = find_checkpoint_folder(path)
    run_config = yaml.safe_load((folder / CONFIG_FILE).read_text()) or {}
    hf_dir = (run_config.get("model") or {}).get("hf_config")
    config = Path(hf_dir) / "config.json" if hf_dir else None
    return kind, run_config, json.loads(config.read_text()) if config is not None and config.is_file() else None


def _resolve(path: Path) -> ModelSource:
    from transformers import AutoConfig

    kind = weights_format(path)
    if kind == "hf":
        return ModelSource(path, kind, path, AutoConfig.from_pretrained(path), path, path)
    if kind == "mcore_model":
        from grpo_mega.checkpoint.mcore_checkpoint import HF_FILES_DIR, read_checkpoint_info  # torch: here only

        hf_files = path / HF_FILES_DIR
        return ModelSource(path, kind, path, read_checkpoint_info(path)[0], hf_files, hf_files)
    folder = find_checkpoint_folder(path)
    run_config = yaml.safe_load((folder / CONFIG_FILE).read_text()) or {}
    model = run_config.get("model") or {}
    hf_dir = Path(model["hf_config"]) if model.get("hf_config") else None
    tokenizer = model.get("tokenizer") or model.get("hf_config")
    hf_config = AutoConfig.from_pretrained(hf_dir) if hf_dir and (hf_dir / "config.json").is_file() else None
    saved_by = "deepspeed" if (folder / DEEPSPEED_METADATA).is_file() else "megatron"
    return ModelSource(path, kind, folder, hf_config, hf_dir, Path(tokenizer) if tokenizer else None,
                       run_config=run_config, saved_by=saved_by)
