"""Sharding the optimizer over data-parallel ranks (``parallel.distributed_optimizer``), and what a rank holds.

With megatron's DistributedOptimizer each of the DP ranks keeps the fp32 master weights and the Adam moments of
one contiguous 1/DP of the gradient buffer: gradients are reduce-scattered instead of all-reduced, each rank
updates its shard, and the updated parameters are all-gathered. The arithmetic is the same as the plain
optimizer's, so a step with it equals a step without it; only the bytes per rank change (12 bytes per
parameter of fp32 master + moments become 12 / DP).

:func:`static_memory_bytes` counts what one rank holds, by the tensors themselves, so that the memory planner
can be checked against the engine.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu

from grpo_mega.engine.held_bytes import storages, torch_optimizer_tensors


CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""How the distributed optimizer's state is checkpointed: megatron's ``fully_reshardable`` format stores each
state tensor in the shape of its parameter (``optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>``), so
dist_checkpointing reshards it to any TP / PP / DP, as it does the model. (Its default, ``fully_sharded_model_space``,
is refused by megatron-core 0.16's dist_checkpointing: "flattened_range is not supported".) Saving gathers each
buffer's state over the DP ranks, one state at a time."""


def prepare_distributed_optimizer_load(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its state tensors, to be overwritten by the load.

    megatron builds the load request from the optimizer's own state dict, which needs Adam's (lazily allocated)
    state: its own helper runs one Adam step on zero gradients. That step may move the parameters (weight
    decay), which is harmless here: the load overwrites the model and the fp32 master copies."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is not None and not inner.state:
            sub._init_optimizer_states_with_dummy_values()


def load_distributed_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` for a (chained) distributed optimizer and a ``fully_reshardable`` state.

    megatron-core 0.16 copies every entry of the optimizer's per-parameter state from the loaded tensors, which
    never carry Adam's ``step`` (it travels in the param groups): with torch's Adam, which keeps ``step`` per
    parameter (TE / Apex fused Adam do not), that is a KeyError. So the param groups and step go first, through
    megatron's load_state_dict, then the per-parameter tensors, with ``step`` set aside while they are copied.
    megatron also hands every parameter the same ``step`` tensor, which torch's Adam increments in place once per
    parameter: each parameter gets its own copy back (else the bias correction runs ahead after a resume)."""
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    states = [state] if len(subs) == 1 else [state[index] for index in sorted(state)]
    for sub, sub_state in zip(subs, states, strict=True):
        param_state = sub_state.pop("param_state", None)
        sharding_type = sub_state.pop("param_state_sharding_type", None)
        sub.load_state_dict(sub_state)
        if param_state is None:
            continue
        if sharding_type != CHECKPOINT_METADATA["distrib_optim_sharding_type"]:
            raise ValueError(f"distributed optimizer state of sharding type {sharding_type!r}, expected "
                             f"{CHECKPOINT_METADATA['distrib_optim_sharding_type']!r}")
        inner_states = [entry for entry in sub.optimizer.state.values()]
        steps = [entry.pop("step", None) for entry in inner_states]
        try:
            sub.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for entry, step in zip(inner_states, steps):
                if step is not None:
                    entry["step"] = step.detach().clone()
    if len(subs) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


def shards_optimizer_state(requested: bool) -> bool:
    """Whether the engine uses megatron's DistributedOptimizer: when requested and there is more than one
    data-parallel rank to shard over (at DP = 1 it would hold the same bytes and add copies)."""
    return bool(requested) and mpu.get_data_parallel_world_size() > 1


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors of megatron's (possibly chained) optimizer: the parameters it updates (fp32 master copies
    or shards of them, or the model's own fp32 parameters) and its state (Adam moments, step counts)."""
    tensors = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:  # a stub optimizer (a rank without trainable parameters)
            continue
        tensors.extend(torch_optimizer_tensors(inner))
    return tensors


def static_memory_bytes(stage: torch.nn.Module, ddp_model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds, by kind, each storage counted once (under the first kind that holds it):

    - ``parameters``: the model parameters (with the distributed optimizer, megatron's contiguous parameter
      buffer, padding included);
    - ``gradients``: the DDP gradient buffers (``main_grad``; fp32), padding included;
    - ``optimizer_state``: what the optimizer adds: fp32 master copies of 16-bit parameters (an fp32 model is its
      own master), Adam's moments and step counts. Adam allocates its moments at the first step, so count after one.
    """
    parameters = storages(stage.parameters())
    buffers = list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))
    gradients = storages(buffer.grad_data for buffer in buffers)
    gradients.update(storages(getattr(p, "main_grad", None) for p in stage.parameters()))
    gradients = {ptr: size for ptr, size in gradients.items() if ptr not in parameters}
    optimizer_state = {
        ptr: size for ptr, size in storages(_optimizer_tensors(optimizer)).items()
        if ptr not in parameters and ptr not in gradients
    }
    return {
        "parameters": sum(parameters.values()),
        "gradients": sum(gradients.values()),
        "optimizer_state": sum(optimizer_state.values()),
    }
