"""Resume an optimizer state saved with the distributed optimizer without it, and the other way round.

Both of megatron's optimizers store Adam's moments per parameter under the same keys
(``optimizer.state.exp_avg.<parameter key>``, ``optimizer.state.exp_avg_sq.<...>``), in the parameter's shape,
so dist_checkpointing can hand either one's moments to the other at any TP / PP / DP. What differs:

- the fp32 master copy: ``optimizer.state.param.<key>`` (distributed, ``fully_reshardable``), or
  ``optimizer.state.fp32_param.<key>`` (plain optimizer, 16-bit model), or none at all (plain optimizer, fp32
  model: the model's own weights ``<key>`` are the master copy);
- the rest of the state dict: where the Adam step count lives (``param_groups[i]["step"]`` vs
  ``state["common_step"]``) and how per-parameter entries are grouped.

So the loader asks for this engine's own optimizer state dict with the master-copy keys renamed to what the
checkpoint holds, places the loaded tensors into that structure, and sets the saved Adam step. Anything it cannot
map is a ValueError at start-up naming ``parallel.distributed_optimizer``, never a silently fresh optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

from grpo_mega.checkpoint import dcp_metadata_compat

SETTING = "parallel.distributed_optimizer"
_STATE = "optimizer.state."
_MASTER = {True: _STATE + "param.", False: _STATE + "fp32_param."}
_ACROSS_KEY = "optimizer_across_modes"  # not a key of any checkpoint: the loaded tensors land here by themselves


def _leaves(tree: Any) -> Iterator[tuple[Any, Any, Any]]:
    """(container, key, value) of every leaf of nested dicts and lists."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, (dict, list)):
            yield from _leaves(value)
        else:
            yield tree, key, value


def _way_out(saved_distributed: bool) -> str:
    return (f"resume with {SETTING}: {str(saved_distributed).lower()} (the setting the checkpoint was saved with), "
            "or start a new run from its weights only (model.init_from=<checkpoint folder>)")


def _saved_key(key: str, *, saved_distributed: bool, saved_keys: set[str]) -> str:
    """The key under which the checkpoint holds what this optimizer calls ``key``."""
    for distributed in (True, False):
        if key.startswith(_MASTER[distributed]) and distributed != saved_distributed:
            parameter = key[len(_MASTER[distributed]):]
            candidates = [_MASTER[saved_distributed] + parameter]
            if not saved_distributed:  # an fp32 model with the plain optimizer is its own master copy
                candidates.append(parameter)
            return next((c for c in candidates if _stored(c, saved_keys)), candidates[0])
    return key


def _stored(key: str, saved_keys: set[str]) -> bool:
    # megatron's gated-MLP factory may store fc1 as two tensors (``_w`` / ``_v``) under one parameter key
    return key in saved_keys or {f"{key}_w", f"{key}_v"} <= saved_keys


def _request_across_modes(request: dict, path: Path, *, saved_distributed: bool) -> dict:
    """Rename, in ``request`` (this optimizer's ShardedStateDict for loading), the fp32 master-copy keys to those
    of a checkpoint saved with ``distributed_optimizer = saved_distributed``; return {index: ShardedBase} of every
    tensor to load. Raises ValueError, naming the setting, when the checkpoint lacks one."""
    dcp_metadata_compat.apply()  # torch >= 2.15: megatron's metadata reader fails without it
    saved_keys = set(dist_checkpointing.load_tensors_metadata(str(path)))
    tensors = {}
    for index, (_, _, leaf) in enumerate(x for x in _leaves(request) if isinstance(x[2], ShardedBase)):
        leaf.key = _saved_key(leaf.key, saved_distributed=saved_distributed, saved_keys=saved_keys)
        if not _stored(leaf.key, saved_keys):
            raise ValueError(
                f"{path} was saved with {SETTING}={str(saved_distributed).lower()} and holds no optimizer tensor "
                f"{leaf.key!r} that this run's optimizer needs; {_way_out(saved_distributed)}"
            )
        tensors[index] = leaf
    return tensors


def _saved_adam_step(saved_common: Any) -> float | None:
    """The Adam step count in the saved non-tensor optimizer state (either optimizer's layout), or None."""
    if isinstance(saved_common, dict):
        state = saved_common.get("state")
        if isinstance(state, dict) and "common_step" in state:
            return float(state["common_step"])
        groups = saved_common.get("param_groups")
        if isinstance(groups, list) and groups and "step" in groups[0]:
            return float(groups[0]["step"])
        children = saved_common.values()
    elif isinstance(saved_common, list):
        children = saved_common
    else:
        return None
    return next((step for step in map(_saved_adam_step, children) if step is not None), None)


def keeps_step_per_group(optimizer) -> bool:
    """Whether megatron's (possibly chained) ``optimizer`` wraps an Adam that keeps its step count, the bias
    correction's ``t``, in each parameter group (Transformer Engine's and apex's FusedAdam: ``group["step"] += 1``
    per step) rather than per parameter (torch's Adam / AdamW: ``state[p]["step"]``)."""
    inner = [getattr(sub, "optimizer", None) for sub in getattr(optimizer, "chained_optimizers", [optimizer])]
    return any(opt is not None and not isinstance(opt, torch.optim.Adam) for opt in inner)


def _set_adam_step(state: Any, step: float, *, distributed: bool, per_group: bool = False) -> None:
    """Put the Adam step count where this optimizer's ``load_state_dict`` reads it: the param groups (the
    distributed optimizer, and any optimizer that keeps it ``per_group``), else megatron's ``common_step``, which its
    load hands to every parameter's state."""
    if not isinstance(state, (dict, list)):
        return
    if isinstance(state, dict) and isinstance(state.get("param_groups"), list):
        if distributed or per_group:
            for group in state["param_groups"]:
                group["step"] = int(step) if per_group else step
        elif isinstance(state.get("state"), dict):
            state["state"]["common_step"] = torch.tensor(step, dtype=torch.float32)
        return
    for child in (state.values() if isinstance(state, dict) else state):
        _set_adam_step(child, step, distributed=distributed, per_group=per_group)


def load_across_modes(engine, path: Path, *, saved_distributed: bool) -> dict:
    """The optimizer state of the checkpoint at ``path``, saved with ``distributed_optimizer = saved_distributed``,
    as a state dict of ``engine``'s optimizer (which has the other setting), for its ``load_optimizer_state_dict``.

    Call it after the model weights are loaded. Its own dist_checkpointing read: for an fp32 model saved with the
    plain optimizer, the master copies are the model's weights, which the model's load already asks for under the
    same keys (one read may not ask for one tensor twice). Raises ValueError, naming the setting, for a
    checkpoint that lacks what this optimizer needs."""
    request = engine.optimizer_sharded_state_dict(engine.model_sharded_state_dict(), is_loading=True)
    tensors = _request_across_modes(request, path, saved_distributed=saved_distributed)
    loaded = dist_checkpointing.load({_ACROSS_KEY: tensors}, str(path))
    step = _saved_adam_step(loaded.get("optimizer"))  # the saved non-tensor state comes along (common state)
    if step is None:
        raise ValueError(f"{path}: the saved optimizer state has no Adam step count; {_way_out(saved_distributed)}")
    index = 0
    for container, key, leaf in _leaves(request):
        if isinstance(leaf, ShardedBase):
            container[key] = loaded[_ACROSS_KEY][index]
            index += 1
        elif isinstance(leaf, LocalNonpersistentObject):
            container[key] = leaf.unwrap()
    _set_adam_step(request, step, distributed=not saved_distributed,
                   per_group=keeps_step_per_group(engine.optimizer))
    return request
