"""What a policy trains and what its training state holds, logged once per run in the metrics row of its
first update (a LoRA policy against full training, issue 78):

- ``model/total_parameters``: every parameter of the whole model (all TP / PP ranks, each tensor once; LoRA's
  adapters included, megatron's padded vocabulary as held);
- ``model/trainable_parameters``: those that require a gradient (with ``model.lora``: the adapters alone);
- ``memory/parameter_bytes``, ``memory/gradient_bytes``, ``memory/optimizer_state_bytes``: what the fullest rank
  holds of each (``grpo_mega.engine.distributed_optimizer.static_memory_bytes``: the weights, the DDP gradient
  buffers, the fp32 master copies and Adam's moments). Adam allocates its moments at its first step, hence the
  first update's row. The DeepSpeed engine (ZeRO) gives the same figures: the model counted whole, the bytes those
  of one rank (every rank holds as much), its ZeRO partitions: the optimizer state at every stage, the gradients
  from ZeRO-2, the parameters at ZeRO-3 (``grpo_mega.engine.deepspeed_figures`` says how each is counted).

Collective: every rank calls :func:`parameter_figures` after the same update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate


def _whole_model_share(param: torch.nn.Parameter) -> int:
    """How many of the whole model's parameters ``param`` (this rank's tensor) adds when every rank of the
    model-parallel group adds its own: a TP shard its elements, a TP-replicated tensor its elements on TP rank 0
    only, the last pipeline stage's copy of tied embeddings (megatron's ``shared``) none; a mixture-of-experts
    expert tensor (``allreduce`` False: each expert-parallel rank holds other experts, equally many) its elements
    times the expert-parallel size."""
    if getattr(param, "shared", False) or not param_is_not_tensor_parallel_duplicate(param):
        return 0
    if not getattr(param, "allreduce", True):
        return param.numel() * mpu.get_expert_model_parallel_world_size()
    return param.numel()


def parameter_counts(stage: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model of which ``stage`` is this rank's part; collective over the
    model-parallel (TP x PP) group."""
    trainable = total = 0
    for param in stage.parameters():
        share = _whole_model_share(param)
        trainable += share if param.requires_grad else 0
        total += share
    counts = _reduced([trainable, total], group=mpu.get_model_parallel_group() if dist.is_initialized() else None)
    return int(counts[0]), int(counts[1])


def _reduced(values: list[float], *, group=None, op=dist.ReduceOp.SUM) -> list[float]:
    """``values`` reduced over ``group`` (the world when None) when torch.distributed is up; a float64 tensor on
    the GPU under NCCL, on the CPU under gloo."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def parameter_figures(engine) -> dict[str, float]:
    """The module docstring's figures of a training engine: a Megatron engine (``engine.stage``,
    ``static_memory_bytes``) or the DeepSpeed engine (its own ``parameter_counts`` of the whole model and
    ``static_memory_bytes`` of what each rank holds: its ZeRO partitions, ``grpo_mega.engine.deepspeed_figures``);
    {} for an engine without them."""
    if not hasattr(engine, "static_memory_bytes"):
        return {}
    if hasattr(engine, "parameter_counts"):  # the DeepSpeed engine: data-parallel only, every rank sees the whole
        trainable, total = engine.parameter_counts()
    elif hasattr(engine, "stage"):
        trainable, total = parameter_counts(engine.stage)
    else:
        return {}
    held = engine.static_memory_bytes()
    largest = _reduced([held["parameters"], held["gradients"], held["optimizer_state"]], op=dist.ReduceOp.MAX)
    return {"model/trainable_parameters": float(trainable), "model/total_parameters": float(total),
            "memory/parameter_bytes": largest[0], "memory/gradient_bytes": largest[1],
            "memory/optimizer_state_bytes": largest[2]}
