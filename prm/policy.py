"""The policy whose samples the PRM commands label and rerank (``grpo-mega prm label``, ``prm eval --policy``): an
hf rollout engine holding its weights, from whatever the user gave (an HF folder, a converted megatron folder, a
grpo-mega training checkpoint or run directory)."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_mega.checkpoint.source import ModelSource


@dataclass
class PolicyRollout:
    """A rollout engine holding a policy's weights, its tokenizer, and where they came from."""

    engine: Any
    tokenizer: Any
    hf_config: Path
    """The HF config folder of the policy's architecture."""
    weights_format: str
    """``hf``, ``mcore_model``, ``training_checkpoint`` or ``training_run`` (:class:`ModelSource` ``kind``)."""
    sync_seconds: float = 0.0
    run_config: dict | None = None
    """A grpo-mega checkpoint's saved run config (its ``rollout.multi_turn`` for ``prm label --steps turns``);
    None for an HF or converted folder."""


def policy_folders(policy: str | Path) -> tuple[ModelSource, Path, Path]:
    """(model source, HF config folder, tokenizer folder) of a policy given as an HF folder with weights, a converted
    megatron folder (its ``hf/`` side files), a grpo-mega training checkpoint or run directory (its saved config's
    ``model.hf_config`` and ``model.tokenizer``); collective (rank 0 resolves the source)."""
    from grpo_mega.checkpoint.source import resolve_model_source

    try:
        source = resolve_model_source(policy)
    except ValueError as error:
        raise ValueError(f"--policy {policy}: {error}") from None
    if not source.is_checkpoint:
        return source, source.hf_config_folder, source.tokenizer_folder
    if source.hf_config_folder is None:
        raise ValueError(f"--policy {policy}: its saved config has no model.hf_config")
    for name, folder in (("model.hf_config", source.hf_config_folder), ("model.tokenizer", source.tokenizer_folder)):
        if not Path(folder).is_dir():
            raise ValueError(f"--policy {policy}: its saved config's {name} {folder} is not a folder (moved? a "
                             "relative path is read from the current directory)")
    return source, source.hf_config_folder, source.tokenizer_folder


def load_policy_rollout(policy: str | Path, *, generation_batch_size: int) -> PolicyRollout:
    """The hf rollout engine with ``policy``'s weights (see :func:`policy_folders`) on this rank's device, built
    as the trainer builds it; collective. An HF folder is loaded directly; other formats are loaded into a
    forward-only Megatron policy engine (at the job's TP) and synced into the rollout engine, as the trainer syncs."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.data.tokenizer import load_tokenizer
    from grpo_mega.engine import build_reference_engine
    from grpo_mega.parallel import get_device
    from grpo_mega.rollout import build_rollout_engine, sync_weights

    source, hf_config, tokenizer_folder = policy_folders(policy)
    tokenizer = load_tokenizer(tokenizer_folder)
    device = get_device()
    engine = build_rollout_engine("hf", model_path=hf_config, tokenizer=tokenizer,
                                  dtype="bfloat16" if device.type == "cuda" else "float32",
                                  generation_batch_size=generation_batch_size, device=device)
    result = PolicyRollout(engine, tokenizer, hf_config, source.kind, run_config=source.run_config)
    if source.kind != "hf":
        forward = build_reference_engine(AutoConfig.from_pretrained(hf_config), max_tokens_per_micro_batch=4096)
        load_initial_weights(forward, source)
        result.sync_seconds = sync_weights(forward.export_hf_weights(), engine, bucket_bytes=256 * 2**20).seconds
        del forward
        gc.collect()
    return result
