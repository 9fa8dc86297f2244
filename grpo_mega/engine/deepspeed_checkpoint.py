"""DeepSpeed engine checkpoints inside grpo-mega's atomic checkpoint folder, and Hugging Face export.

``grpo_mega.checkpoint.training.CheckpointManager`` stages, publishes (``complete.json``, rename, ``latest``) and
prunes as for the Megatron engine; for a DeepSpeed engine the staging folder holds::

  deepspeed/zero/...                  DeepSpeed's save_checkpoint (tag "zero"): model, ZeRO optimizer partitions
  deepspeed/rng/rank_00000.pt ...     each rank's RNG states
  deepspeed/trainer_state.pt          the learning-rate schedule and the trainer's extra_state (rank 0)
  deepspeed/grpo_mega_deepspeed.json  written last: ZeRO stage, number of processes, tag

ZeRO partitions belong to one number of processes and one stage: a resume must use the same ones (a clear error
otherwise); the weights alone load anywhere, by either engine, through
``grpo_mega.engine.source_weights.deepspeed_checkpoint_weights`` (``model.init_from``; a LoRA run's base with its
adapters merged; ``grpo_mega.checkpoint.source`` tells such a folder by its metadata file), and
:func:`export_weights_to_hf` writes them as a Hugging Face folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_mega.checkpoint.training_files import DEEPSPEED_METADATA, write_file_atomic
from grpo_mega.engine.lr_schedule import keep_optimizer_settings, optimizer_settings

DS_DIR = "deepspeed"
TAG = "zero"
TRAINER_STATE = "trainer_state.pt"


def _rng_file(root: Path, rank: int) -> Path:
    return root / "rng" / f"rank_{rank:05d}.pt"


def save_training_state(engine, folder, *, rng_state, scheduler: dict, extra_state: dict) -> None:
    """Write ``engine``'s state into ``folder`` (see the module docstring); collective."""
    root = Path(folder) / DS_DIR
    # LoRA: the adapters alone (their ZeRO optimizer state too); the frozen base is model.init_from's
    engine.ds.save_checkpoint(str(root), tag=TAG, save_latest=False,
                              exclude_frozen_parameters=engine.lora is not None)
    _rng_file(root, engine.rank).parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state, _rng_file(root, engine.rank))
    if engine.rank == 0:
        torch.save({"scheduler": scheduler, "extra_state": extra_state}, root / TRAINER_STATE)
    dist.barrier()  # every rank's files are written before the marker
    if engine.rank == 0:
        info = {"zero_stage": engine.zero_stage, "world_size": engine.world_size, "tag": TAG}
        write_file_atomic(Path(folder) / DEEPSPEED_METADATA, json.dumps(info, indent=2) + "\n")


def load_training_state(engine, folder, *, with_optimizer: bool, with_rng: bool) -> dict:
    """Restore ``engine`` from ``folder``; returns {"scheduler", "extra_state", "rng_state", "optimizer_changes"}.

    The optimizer's hyperparameters stay the engine's (the current config); ``optimizer_changes`` lists those that
    differ from the checkpoint's as ``"name old -> new"``. Raises ValueError when the checkpoint was saved at
    another ZeRO stage or number of processes."""
    folder = Path(folder)
    root = folder / DS_DIR
    info = json.loads((folder / DEEPSPEED_METADATA).read_text())
    if (info["zero_stage"], info["world_size"]) != (engine.zero_stage, engine.world_size):
        raise ValueError(
            f"{folder} holds DeepSpeed ZeRO-{info['zero_stage']} partitions of {info['world_size']} processes; this "
            f"job runs ZeRO-{engine.zero_stage} on {engine.world_size}: resume with deepspeed.zero_stage="
            f"{info['zero_stage']} on {info['world_size']} processes, or start a new run from its weights "
            f"(model.init_from={folder})"
        )
    _check_same_adapters(engine, folder)
    built = optimizer_settings(engine.optimizer)
    engine.ds.load_checkpoint(str(root), tag=info["tag"], load_optimizer_states=with_optimizer,
                              load_lr_scheduler_states=False, load_module_strict=engine.lora is None)
    if not with_optimizer:
        engine.reload_after_weight_load()
    changes = keep_optimizer_settings(engine.optimizer, built)
    state = torch.load(root / TRAINER_STATE, weights_only=True)
    rng_state = torch.load(_rng_file(root, engine.rank), weights_only=True) if with_rng else None
    return {"scheduler": state["scheduler"], "extra_state": state["extra_state"], "rng_state": rng_state,
            "optimizer_changes": changes}


def _check_same_adapters(engine, folder: Path) -> None:
    """DeepSpeed loads the module's state non-strictly with LoRA (the base is not saved): the checkpoint's adapters
    must be this engine's (same rank and target_modules, peft's layout), or a ValueError names the difference."""
    from grpo_mega.checkpoint.training_files import lora_settings

    saved = lora_settings(folder)
    mine = engine.lora.describe() if engine.lora is not None else None
    keys = ("rank", "target_modules", "format")

    def shown(lora):
        return "no LoRA" if lora is None else "LoRA " + ", ".join(f"{k}={lora.get(k)}" for k in keys)

    if (saved is None) != (mine is None) or (saved and any(saved.get(k) != mine[k] for k in keys)):
        raise ValueError(f"{folder} holds {shown(saved)}; this job has {shown(mine)}: set model.lora to the "
                         "checkpoint's, or start a new run from it (model.init_from)")


def saved_deepspeed_weights(folder) -> dict[str, torch.Tensor]:
    """The fp32 tensors DeepSpeed saved (a LoRA run's: the adapters alone, under peft's module names)."""
    from grpo_mega.engine.deepspeed_setup import import_deepspeed

    import_deepspeed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    info = json.loads((Path(folder) / DEEPSPEED_METADATA).read_text())
    return dict(get_fp32_state_dict_from_zero_checkpoint(str(Path(folder) / DS_DIR), tag=info["tag"]))


def export_deepspeed_lora_adapter(folder: str | os.PathLike, out_dir: str | os.PathLike, *,
                                  dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write a DeepSpeed-engine LoRA checkpoint's adapters as a PEFT adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, out_dir)``), in one process; the files written.
    Its tensors are peft's already: only the adapter name leaves their names."""
    from grpo_mega.checkpoint.peft_export import PEFT_PREFIX, write_peft_adapter
    from grpo_mega.engine.deepspeed_lora import ADAPTER
    from grpo_mega.checkpoint.training_files import lora_settings

    lora = lora_settings(folder)
    if lora is None:
        raise ValueError(f"{folder} is not a checkpoint of a LoRA run (model.lora.rank > 0)")
    tensors = {PEFT_PREFIX + name.replace(f".{ADAPTER}.weight", ".weight"): tensor
               for name, tensor in saved_deepspeed_weights(folder).items() if ".lora_" in name}
    return write_peft_adapter(Path(out_dir), lora, tensors, dtype)


def _write_hf_folder(named_tensors, out_dir: Path, hf_config, side_files_from, write: bool) -> Path:
    from grpo_mega.checkpoint.hf_io import SafetensorsShardWriter, copy_side_files

    writer = SafetensorsShardWriter(out_dir) if write else None
    for name, tensor in named_tensors:  # every rank iterates: the tensors may come from collectives
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        if side_files_from is not None:
            copy_side_files(side_files_from, out_dir)
        hf_config.save_pretrained(out_dir)  # the architecture, also without side files
    return out_dir


def save_hf_checkpoint(engine, out_dir: str | os.PathLike, *, side_files_from: str | os.PathLike | None = None) -> Path:
    """Write the engine's weights as a Hugging Face folder (safetensors shards, config.json, and the tokenizer and
    other side files of ``side_files_from``) loadable with ``AutoModelForCausalLM.from_pretrained``; collective
    (ZeRO-3 gathers in buckets), rank 0 writes. Returns the folder."""
    out_dir = Path(out_dir)
    write = dist.get_rank() == 0
    _write_hf_folder(engine.export_hf_weights(), out_dir, engine.hf_config, side_files_from, write)
    dist.barrier()
    return out_dir


def export_weights_to_hf(weights: dict[str, torch.Tensor], out_dir: str | os.PathLike, hf_config, *,
                         side_files_from: str | os.PathLike | None = None,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write whole HF-named weights (a DeepSpeed-engine training checkpoint's: ``grpo_mega.engine.source_weights.
    deepspeed_checkpoint_weights``), cast to ``dtype``, as a Hugging Face folder, in one process. Returns the folder."""
    if getattr(hf_config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # HF checkpoints of tied models store the embedding only
    hf_config.dtype = dtype
    named = ((name, tensor.to(dtype)) for name, tensor in weights.items())
    return _write_hf_folder(named, Path(out_dir), hf_config, side_files_from, True)
