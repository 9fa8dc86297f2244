"""Build a rollout engine by name: the one module that knows every engine (as ``grpo_mega.engine.factory`` is for
the training engines), so the engines import the interface in ``base`` and nothing imports them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpo_mega.rollout.base import RolloutEngine

ENGINE_NAMES = ("hf", "vllm")


def build_rollout_engine(
    name: str, *, model_path: str | Path, tokenizer: Any, dtype: str | torch.dtype, **engine_kwargs
) -> RolloutEngine:
    """Build the rollout engine ``name`` ("hf" or "vllm") for the model in ``model_path``.

    ``model_path`` is a Hugging Face folder: with weights (``*.safetensors`` / ``pytorch_model*.bin``) they are
    loaded; with only ``config.json`` the engine starts with placeholder weights and refuses to generate until a
    full weight update has arrived. ``tokenizer`` is a tokenizer folder or a loaded transformers tokenizer.
    ``engine_kwargs`` go to the engine (hf: ``generation_batch_size``, ``device``; vllm: see
    :class:`grpo_mega.rollout.vllm_engine.VLLMRolloutEngine`).
    """
    # Imported here: an engine's own dependencies (vLLM) load only when that engine is built.
    if name == "hf":
        from grpo_mega.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine.from_pretrained(model_path, tokenizer, dtype=dtype, **engine_kwargs)
    if name == "vllm":
        from grpo_mega.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, tokenizer, dtype=dtype, **engine_kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; expected one of {ENGINE_NAMES}")
