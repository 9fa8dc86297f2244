"""A LoRA run's adapters as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), the
folder ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the Hugging Face base model.

Our adapters sit on megatron's fused linears (``grpo_mega.lora``); peft's on Hugging Face's separate ones. One
adapter of a fused linear is exactly several peft adapters sharing its A: the fused W + s B A splits by rows like
W does, so q_proj's update is s B_q A with B_q the rows of B that ``linear_qkv``'s layout gives q_proj (likewise
k, v; ``linear_fc1``'s gate and up halves). So B of a column-parallel linear is gathered over TP and split with
the weight's own layout (``grpo_mega.checkpoint.hf_transforms``: the layouts work on any column count), A copied
to every piece; A of a row-parallel linear (``linear_proj`` -> o_proj, ``linear_fc2`` -> down_proj) is gathered
with the weight's column split, B is whole. peft's scale is ``lora_alpha / r``, ours alpha / rank: the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PEFT_PREFIX = "base_model.model."
"""What peft puts before a base model's parameter names in ``adapter_model.safetensors``."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_tensor_name(hf_weight_name: str, part: str) -> str:
    """peft's name of ``part`` (``A`` / ``B``) of the adapter on the HF weight ``hf_weight_name``:
    ``model.layers.0.self_attn.q_proj.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    module = hf_weight_name.removesuffix(".weight")
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def stage_peft_tensors(stage: torch.nn.Module, adapters, hf_config: Any) -> dict[str, torch.Tensor]:
    """peft's tensors (name -> full tensor on the CPU) of the adapters of this pipeline stage; collective over the
    TP group (each sharded A or B is all-gathered). ``adapters``: the stage's ``grpo_mega.lora.StageAdapters``."""
    from megatron.core import parallel_state

    from grpo_mega.checkpoint.hf_convert import _gather_tp, _model_rows

    dims, rows, tensors = _model_rows(stage, hf_config)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for row in rows:
        adapter = adapters.adapter_of(tensors[row.mcore])
        if adapter is None:
            continue
        # the factor split over TP like the weight (B's rows of a column-parallel W, A's columns of a row one)
        sharded = "B" if adapter.kind == "column" else "A"
        for part in ("A", "B"):
            tensor = getattr(adapter, part).detach()
            if part == sharded:
                pieces = row.layout.to_hf(_gather_tp(tensor, row, tp_group, tp_size), dims)
            else:
                pieces = (tensor,) * len(row.hf)
            for hf_name, piece in zip(row.hf, pieces):
                out[peft_tensor_name(hf_name, part)] = piece.to("cpu", copy=True).contiguous()
    return out


def gather_peft_tensors(stage: torch.nn.Module, adapters, hf_config: Any) -> dict[str, torch.Tensor]:
    """Every stage's :func:`stage_peft_tensors`, on every rank (adapters are small: gathered as objects over the
    PP group); collective."""
    from megatron.core import parallel_state

    mine = stage_peft_tensors(stage, adapters, hf_config)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return mine
    stages: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
    return {name: tensor for stage_tensors in stages for name, tensor in stage_tensors.items()}


def peft_target_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Hugging Face's module names the adapters sit on (``q_proj``, ``o_proj``, ...), peft's ``target_modules``."""
    return sorted({name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1]
                   for name in tensors if name.endswith(".lora_A.weight")})


def peft_adapter_config(settings: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """``adapter_config.json`` of a LoRA checkpoint whose ``lora`` entry is ``settings`` (rank, alpha, base)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": settings.get("base"),
        "r": int(settings["rank"]),
        "lora_alpha": float(settings["alpha"]),
        "lora_dropout": 0.0,
        "target_modules": peft_target_modules(tensors),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,  # peft's scale is then lora_alpha / r, ours
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(out: Path, settings: dict, tensors: dict[str, torch.Tensor],
                       dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out`` (rank 0); the files written."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor if dtype is None else tensor.to(dtype) for name, tensor in sorted(tensors.items())}
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(settings, tensors), indent=2) + "\n")
    return [out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS]
