"""The DeepSpeed training engine's parameter counts and what one rank holds of the weights, gradients and optimizer
state: ``grpo_mega.perf.parameters.parameter_figures`` logs them with the first update, as for the Megatron engine.

ZeRO partitions over the data-parallel ranks (all of them): the optimizer state at every stage (its fp32 master
copies and Adam's moments), the gradients from stage 2, the parameters at stage 3. The bytes are this rank's share
at the job's stage, read from the tensors it holds (ZeRO pads partitions to equal sizes, so every rank holds as
much): a ZeRO-3 parameter its partition (``ds_tensor``), any other its whole tensor. Gradients are not persistent
tensors in DeepSpeed (ZeRO fills buffers during backward and frees them at the step), so their figure is the
gradient of every trainable parameter at ZeRO-1 (each rank's backward produces all of it before the reduction) and
this rank's 1/N partition of it at ZeRO-2/3, in the gradients' dtype (the parameters': bf16 on a GPU, fp32 on the
CPU; ``engine.deepspeed_setup`` sets no other accumulation dtype); DeepSpeed's reduce buckets and the fp32 copy of
the gradient partition made at the step are not counted. The optimizer state is what ZeRO's torch optimizer
holds beyond the model's own tensors: the fp32 master partition (none of its own at ZeRO-3 when the weights are fp32
already, on the CPU: ZeRO-3 then steps the model's partition itself) and Adam's two moments. With ``deepspeed.offload_optimizer`` the optimizer state
lies in host memory: still counted, as what this rank holds.
"""

from __future__ import annotations

import math

import torch

from grpo_mega.engine.held_bytes import storages, torch_optimizer_tensors


def _whole_numel(param: torch.nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # a ZeRO-3 parameter's whole size


def _held_bytes(param: torch.nn.Parameter) -> int:
    held = param.ds_tensor if hasattr(param, "ds_tensor") else param  # ZeRO-3: this rank's partition
    return held.numel() * held.element_size()


def parameter_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model (ZeRO-3 partitions counted whole, tied weights once; with
    LoRA the adapters are the trainable ones and count in the total)."""
    trainable = total = 0
    for param in module.parameters():
        numel = _whole_numel(param)
        total += numel
        trainable += numel if param.requires_grad else 0
    return trainable, total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> int:
    """Bytes of ``optimizer``'s parameters and state (the torch optimizer ZeRO steps: its parameters are ZeRO's fp32
    master partitions, its state Adam's moments of them), each storage once; a tensor that is a model parameter's
    own storage is the model's (counted with the parameters)."""
    params = list(module.parameters())
    model = storages(params) | storages(p.ds_tensor for p in params if hasattr(p, "ds_tensor"))
    return sum(size for ptr, size in storages(torch_optimizer_tensors(optimizer)).items() if ptr not in model)


def static_memory_bytes(engine) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state"}: bytes this rank of the DeepSpeed training ``engine`` holds
    (the module docstring says how each is counted)."""
    params = list(engine.module.parameters())
    trainable = sum(_whole_numel(p) for p in params if p.requires_grad)
    grad_size = next((p.element_size() for p in params if p.requires_grad), 0)
    grad_elements = trainable if engine.zero_stage == 1 else math.ceil(trainable / engine.world_size)
    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)  # ZeRO's wrapper -> the torch optimizer
    return {"parameters": sum(_held_bytes(p) for p in params), "gradients": grad_elements * grad_size,
            "optimizer_state": optimizer_state_bytes(inner, engine.module)}
