"""A converted model on disk in megatron format: loadable at any TP/PP, with the HF files it came from.

Folder layout:
  <dir>/                        megatron dist_checkpointing files (torch_dist: metadata, *.distcp; common.pt to 0.16)
  <dir>/hf/                     the source model's config.json, tokenizer and generation files (no weights)
  <dir>/grpo_mega_model.json    what this is: model_type, vocab sizes, the TP/PP it was saved at, dtype

dist_checkpointing stores every tensor with its global shape and this rank's slice, so loading at
another TP/PP reshards (the SwiGLU fc1 layout included); only the padded vocabulary must match.
A classifier PRM (Qwen2ForProcessRewardModel) is stored with its head (`head.score.*`, last stage).
This is a weights-only format for moving models between tools; training state (optimizer, step)
belongs to the training checkpoints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_mega.checkpoint.extra_state import load_sharded
from grpo_mega.checkpoint.hf_io import copy_side_files
from grpo_mega.checkpoint.hf_layouts import architecture_for
from grpo_mega.checkpoint.training_files import MCORE_MODEL_INFO_FILE

INFO_FILE = MCORE_MODEL_INFO_FILE
HF_FILES_DIR = "hf"
FORMAT_NAME = "grpo_mega.mcore_model"
FORMAT_VERSION = 1


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def save_mcore_checkpoint(model: torch.nn.Module, ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike) -> None:
    """Save a built megatron model (this rank's part) and the side files of `hf_dir`; collective.

    Every rank calls it with its own part of the model. Raises ValueError when `ckpt_dir` exists and
    is not empty (nothing is overwritten) or when `hf_dir` has no config.json.
    """
    from megatron.core import dist_checkpointing, parallel_state

    ckpt_dir, hf_dir = Path(ckpt_dir), Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json to store beside the megatron weights")
    if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise ValueError(f"output folder {ckpt_dir} is not empty; choose a new one")
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    gpt = _gpt(model)
    dist_checkpointing.save(gpt.sharded_state_dict(), str(ckpt_dir))
    if dist.get_rank() == 0:
        copy_side_files(hf_dir, ckpt_dir / HF_FILES_DIR)
        config = json.loads((hf_dir / "config.json").read_text())
        info = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "vocab_size": config.get("vocab_size"),
            "padded_vocab_size": gpt.vocab_size,
            "saved_tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            "saved_pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
            "dtype": str(next(gpt.parameters()).dtype).removeprefix("torch."),
        }
        (ckpt_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    dist.barrier()


def read_checkpoint_info(ckpt_dir: str | os.PathLike) -> tuple[Any, dict]:
    """Return (HF config, info dict) of a checkpoint written by `save_mcore_checkpoint`.

    Raises ValueError naming the file when the folder is not such a checkpoint.
    """
    from transformers import AutoConfig

    ckpt_dir = Path(ckpt_dir)
    info_path = ckpt_dir / INFO_FILE
    if not info_path.is_file():
        raise ValueError(f"{ckpt_dir} is not a grpo_mega megatron checkpoint: {INFO_FILE} is missing")
    info = json.loads(info_path.read_text())
    if info.get("format") != FORMAT_NAME or info.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{info_path}: format {info.get('format')!r} version {info.get('version')!r}, "
            f"expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    if not (ckpt_dir / HF_FILES_DIR / "config.json").is_file():
        raise ValueError(f"{ckpt_dir / HF_FILES_DIR} has no config.json")
    return AutoConfig.from_pretrained(ckpt_dir / HF_FILES_DIR), info


def load_mcore_checkpoint(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Load a checkpoint's model into a built megatron model at this job's TP/PP; collective.

    Resharding is dist_checkpointing's. Only the tensors the checkpoint's weight table covers are read
    (`model_prefixes`): for a causal LM the GPTModel's own tensors, so heads attached to the backbone
    (e.g. a PRM scorer) keep their values; for a classifier PRM also its head. The model may lack the
    checkpoint's LM output layer (a classifier PRM initialised from a policy: the policy's LM head is
    not read), not the other way round. Raises ValueError when the folder is not a checkpoint, when the
    model's padded vocabulary differs from the saved one, when the model needs an LM output layer the
    checkpoint does not have, or when the checkpoint lacks tensors of the model (megatron raises for a
    global shape mismatch). Transformer Engine's `_extra_state` objects are not required either way: a checkpoint
    of the local layer spec loads into TE layers and the other way round (`grpo_mega.checkpoint.extra_state`).
    """
    hf_config, info = read_checkpoint_info(ckpt_dir)
    table = architecture_for(hf_config)
    gpt = _gpt(model)
    if gpt.vocab_size != info["padded_vocab_size"]:
        raise ValueError(
            f"{Path(ckpt_dir) / INFO_FILE}: saved with padded_vocab_size={info['padded_vocab_size']}, "
            f"but the model was built with {gpt.vocab_size}"
        )
    if getattr(gpt, "lm_output", True) and not table.lm_output:
        raise ValueError(
            f"{ckpt_dir} holds a {table.label} model without an LM output layer; the model to load it into "
            "has one (build it with lm_output=False)"
        )
    covered = {name: sharded for name, sharded in gpt.sharded_state_dict().items()
               if name.startswith(table.model_prefixes)}
    state = load_sharded(covered, ckpt_dir)
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    missing = [name for name in missing if name.startswith(table.model_prefixes)]
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: model tensors missing {missing[:8]}, unexpected {unexpected[:8]}")
