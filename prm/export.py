"""A grpo-mega PRM as the Hugging Face folder vLLM loads (``scorer: vllm``): exported once, cached in the checkpoint.

vLLM loads Hugging Face folders only, while ``process_reward.prm`` / ``--prm`` may name what the engine scorer
loads: a ``grpo-mega prm train`` checkpoint, its run directory (the newest checkpoint that verifies), or a
converted megatron folder (``tools/convert_hf_to_mcore.py``). :func:`hf_folder_for_vllm` gives vLLM a folder for
any of them: an HF folder as it is, the others exported into ``hf_export/`` inside the checkpoint (or converted)
folder, so the export lives and is pruned with its checkpoint.

- Once: a later run finds ``hf_export/`` and reads it, after checking it (below); a run directory whose newest
  checkpoint changed exports that one, into that checkpoint.
- Atomically: written into a staging folder beside it (``.tmp-hf_export-<host>-<pid>-*``), published by one rename
  after every file and the manifest are written; a crash leaves a staging folder, never a half export under the
  real name. The next use (an export, or a read of a verified one) removes such leftovers (a 7B PRM's is 15 GB):
  those of a process gone on this host, and any nothing was written in for :data:`STALE_STAGING_S` (another node's
  crash, a pid reused); another job's export in progress is left alone.
- Content-checked as the training checkpoints are (``grpo_mega.run.checkpoints``): the manifest ``export.json``
  lists every file with its size and CRC-32, and the CRC-32 of the marker file of the checkpoint it came from
  (``complete.json``, ``grpo_mega_model.json`` of a converted folder). Every use verifies all of them, on rank 0; an
  export that does not match (a file altered, truncated or missing, or a checkpoint replaced under the same name)
  is exported again, with one warning naming the file.

The weights: a Megatron checkpoint is loaded on this job's layout (``init_distributed``'s TP / PP: the layout the
engine scorer would load it at) into the conversion model of ``tools/convert_mcore_to_hf.py`` and gathered tensor
by tensor (``export_hf_weights``); rank 0 writes them in the stored dtype. A DeepSpeed one is merged by rank 0
(``export_weights_to_hf``). The tokenizer the PRM was trained with is saved beside them (vLLM maps
``lm_tokens``' label tokens with it). Collective: every rank of the job calls it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from grpo_mega.checkpoint.mcore_checkpoint import INFO_FILE
from grpo_mega.checkpoint.collective import is_distributed, rank0_decides
from grpo_mega.checkpoint.source import ModelSource
from grpo_mega.perf.memory import free_cached_memory
from grpo_mega.run.checkpoints import CHECKSUM_ALGORITHM, file_checksum
from grpo_mega.run.layout import COMPLETE_FILE, TMP_PREFIX
from grpo_mega.run.procfs import alive

logger = logging.getLogger(__name__)

EXPORT_DIR = "hf_export"
"""The export's folder inside the checkpoint (or converted) folder."""
MANIFEST = "export.json"
FORMAT = ("grpo_mega.prm_hf_export", 1)
STALE_STAGING_S = 3600.0
"""A staging folder of another host with nothing written in it for this long is a crashed export's."""


def export_folder(source: ModelSource) -> Path:
    """Where ``source``'s export lives: ``hf_export/`` inside the folder holding its weights."""
    return source.folder / EXPORT_DIR


def _marker(source: ModelSource) -> dict[str, str]:
    """The file that identifies the weights exported, and its CRC-32."""
    name = COMPLETE_FILE if source.is_checkpoint else INFO_FILE
    return {"file": name, CHECKSUM_ALGORITHM: file_checksum(source.folder / name)}


def export_problem(folder: Path, source: ModelSource) -> str | None:
    """Why ``folder`` is not a valid export of ``source`` (one line), None when every file matches the manifest
    and the manifest names ``source``'s checkpoint as it is now."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing"
    try:
        recorded = json.loads(manifest.read_text())
        kind = (recorded["format"], recorded["version"])
        files = {str(name): (int(entry["bytes"]), str(entry[CHECKSUM_ALGORITHM]))
                 for name, entry in recorded["files"].items()}
        marker = recorded["source"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{manifest} is unreadable ({type(error).__name__}: {error})"
    if kind != FORMAT:
        return f"{manifest} names format {kind}, expected {FORMAT}"
    if marker != _marker(source):
        return f"{manifest} was written for another {marker.get('file')} than {source.folder}'s (checkpoint replaced)"
    for name, (size, checksum) in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {MANIFEST} recorded {size}"
        if file_checksum(path) != checksum:
            return f"{path}: {CHECKSUM_ALGORITHM} differs from the one {MANIFEST} recorded (the file changed)"
    return None


def hf_folder_for_vllm(source: ModelSource, tokenizer: Any) -> Path:
    """The HF folder vLLM loads for ``source`` (module docstring); collective. ``tokenizer``: the PRM's (saved with
    an export). ValueError, in one line naming the folder, when an export is needed and the folder is not
    writable."""
    if source.kind == "hf":
        return source.folder
    target = export_folder(source)
    problem = rank0_decides(lambda: export_problem(target, source))
    if problem is None:
        logger.info("scorer=vllm: reading the PRM export %s (verified)", target)
        rank0_decides(lambda: remove_stale_staging(source.folder))  # a crashed export's, even when none is due
        return target
    staging = rank0_decides(lambda: _staging_folder(source, target, problem))
    _write_weights(source, staging)
    rank0_decides(lambda: _publish(source, tokenizer, staging, target))
    return target


def _staging_folder(source: ModelSource, target: Path, problem: str) -> Path:
    if not os.access(source.folder, os.W_OK):
        raise ValueError(
            f"scorer=vllm: the PRM {source.path} needs a Hugging Face export and its folder {source.folder} is not "
            f"writable; export it: python tools/convert_mcore_to_hf.py --ckpt {source.path} --out PRM_HF, then give "
            "PRM_HF as the PRM (process_reward.prm / --prm) with the layout and tag it was trained with")
    if target.exists():
        logger.warning("scorer=vllm: exporting the PRM %s for vLLM again: %s", source.path, problem)
    else:
        logger.info("scorer=vllm: writing a Hugging Face export of the PRM %s into its folder: %s (vLLM loads HF "
                    "folders only; written once, reused by later runs, removed with the checkpoint)", source.path,
                    target)
    remove_stale_staging(source.folder)
    staging = source.folder / f"{_STAGING_PREFIX}{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


_STAGING_PREFIX = f"{TMP_PREFIX}{EXPORT_DIR}-"


def _host() -> str:
    return socket.gethostname().split(".")[0].replace("-", "_")


def remove_stale_staging(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the staging folders of crashed exports in ``folder`` (module docstring); the ones removed."""
    now = time.time() if now is None else now
    removed = []
    for staging in sorted(folder.glob(f"{_STAGING_PREFIX}*")):
        host, _, rest = staging.name.removeprefix(_STAGING_PREFIX).partition("-")
        pid = rest.partition("-")[0]
        ours = host == _host() and pid.isdigit()
        if ours and (not alive(int(pid)) or int(pid) == os.getpid()):  # its exporter is gone (or was this one)
            stale = True
        else:  # another host's, a pid taken again, or named before the host and pid were: by its newest write
            written = [path.stat().st_mtime for path in [staging, *staging.rglob("*")] if path.exists()]
            stale = now - max(written, default=0.0) > STALE_STAGING_S
        if stale:
            logger.warning("scorer=vllm: removing %s, left by an export that did not finish", staging)
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _write_weights(source: ModelSource, out: Path) -> None:
    """The PRM's safetensors in ``out``: gathered from this job's layout (Megatron), or merged by rank 0
    (DeepSpeed); collective."""
    import torch.distributed as dist

    hf_config = source.hf_config
    if source.saved_by == "deepspeed":
        from grpo_mega.engine.deepspeed_checkpoint import export_weights_to_hf
        from grpo_mega.engine.source_weights import deepspeed_checkpoint_weights

        def merge() -> None:
            export_weights_to_hf(deepspeed_checkpoint_weights(source.folder), out, hf_config)

        rank0_decides(merge)
        return
    from grpo_mega.checkpoint import SafetensorsShardWriter, read_checkpoint_info
    from grpo_mega.checkpoint.training_files import read_checkpoint_state

    if source.is_checkpoint:
        stored = read_checkpoint_state(source.folder).get("param_dtype", "float32")
    else:
        stored = read_checkpoint_info(source.folder)[1]["dtype"]
    writer = SafetensorsShardWriter(out) if not is_distributed() or dist.get_rank() == 0 else None
    write_megatron_weights(source.folder, hf_config, training_checkpoint=source.is_checkpoint, stored_dtype=stored,
                           writer=writer)
    if writer is not None:
        writer.close()
        hf_config.save_pretrained(out)
    free_cached_memory()  # a GPU job's scorer needs the conversion model's memory back before vLLM starts


def write_megatron_weights(folder: Path, hf_config: Any, *, training_checkpoint: bool, stored_dtype: str, writer,
                           out_dtype: torch.dtype | None = None) -> None:
    """Every Hugging Face tensor of the megatron checkpoint ``folder`` (a training checkpoint, or a converted folder)
    into ``writer`` (a ``SafetensorsShardWriter`` on rank 0, None on the others), ``out_dtype`` or as stored;
    collective. The conversion model is built on this job's TP / PP / EP layout (:func:`conversion_stage`) and
    gathered tensor by tensor (``export_hf_weights``: rank 0 holds one tensor extra); it is freed before returning.
    A LoRA run's checkpoint (adapters only) gives its base with the adapters merged in. Also
    ``tools/convert_mcore_to_hf.py``'s export."""
    from grpo_mega.checkpoint import export_hf_weights, load_mcore_checkpoint
    from grpo_mega.checkpoint.source import locate_checkpoint
    from grpo_mega.checkpoint.weights_only import load_model_state
    from grpo_mega.checkpoint.training_files import lora_settings
    from grpo_mega.engine.source_weights import load_merged_lora_checkpoint

    if training_checkpoint:
        folder = locate_checkpoint(folder)
    lora = lora_settings(folder) if training_checkpoint else None
    model = conversion_stage(hf_config, stored_dtype, local_layers=lora is not None)
    if lora is not None:
        load_merged_lora_checkpoint(model, folder, lora)
    elif training_checkpoint:
        load_model_state(model, folder)
    else:
        load_mcore_checkpoint(model, folder)
    for name, tensor in export_hf_weights(model, hf_config):
        if writer is not None:
            writer.add(name, tensor if out_dtype is None else tensor.to(out_dtype))
    del model


def write_peft_adapter_folder(folder: Path, hf_config: Any, out: Path | None, *, stored_dtype: str,
                              out_dtype: torch.dtype | None = None) -> list[Path]:
    """The adapters of the LoRA checkpoint ``folder`` as a PEFT adapter folder in ``out`` (rank 0; None on the
    other ranks), gathered over this job's TP / PP (``grpo_mega.checkpoint.peft_export``); collective. The base
    weights are not read. ValueError naming the folder when it holds a whole model. Returns the files written."""
    from grpo_mega.checkpoint.peft_export import gather_peft_tensors, write_peft_adapter
    from grpo_mega.checkpoint.source import locate_checkpoint
    from grpo_mega.checkpoint.training_files import lora_settings
    from grpo_mega.engine.source_weights import read_lora_adapters

    folder = locate_checkpoint(folder)
    lora = lora_settings(folder)
    if lora is None:
        raise ValueError(f"{folder} holds a whole model, not LoRA adapters (model.lora.rank was 0): export it "
                         "without --peft-adapter")
    model = conversion_stage(hf_config, stored_dtype, local_layers=True)
    tensors = gather_peft_tensors(model, read_lora_adapters(model, folder, lora), hf_config)
    del model
    return [] if out is None else write_peft_adapter(out, lora, tensors, out_dtype)


def conversion_stage(hf_config: Any, stored_dtype: str, *, local_layers: bool = False) -> torch.nn.Module:
    """This rank's stage of the conversion model of ``hf_config`` (``prm.engines.build_conversion_stage``) on this
    job's TP / PP / EP layout, in the stored dtype (float32 for any other, so loading is exact), not initialised.
    ``local_layers``: megatron-core's local layers also on a GPU (LoRA adapters sit on those, not on TE's)."""
    from megatron.core import parallel_state

    from grpo_mega.model import gpt_config_from_hf
    from prm.engines import build_conversion_stage

    dtype = getattr(torch, stored_dtype) if stored_dtype in ("float32", "bfloat16") else torch.float32
    gpt_config = gpt_config_from_hf(
        hf_config, tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(), dtype=dtype,
        ep=parallel_state.get_expert_model_parallel_world_size(), overrides={"perform_initialization": False})
    return build_conversion_stage(hf_config, gpt_config, local_layers=local_layers)


def _publish(source: ModelSource, tokenizer: Any, staging: Path, target: Path) -> None:
    """Rank 0: the tokenizer and the manifest into ``staging``, then ``staging`` renamed to ``target`` (a stale
    ``target`` removed first; when another job published a valid one meanwhile, that one is kept)."""
    tokenizer.save_pretrained(staging)
    files = {}
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        name = path.relative_to(staging).as_posix()
        files[name] = {"bytes": path.stat().st_size, CHECKSUM_ALGORITHM: file_checksum(path)}
    manifest = {"format": FORMAT[0], "version": FORMAT[1], "source": _marker(source), "files": files}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if target.exists():
        shutil.rmtree(target)
    try:
        os.rename(staging, target)
    except OSError:  # another job published the same export between the removal and the rename
        if export_problem(target, source) is not None:
            raise
        shutil.rmtree(staging)
        return
    logger.info("scorer=vllm: wrote the PRM export %s (%d files)", target, len(files))
