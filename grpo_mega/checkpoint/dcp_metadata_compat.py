"""megatron-core's reader of torch_dist checkpoint metadata beside torch >= 2.15: one keyword dropped, nothing else.

torch 2.15 added the field ``strides`` to ``torch.distributed.checkpoint.metadata.TensorProperties``. megatron-core
(0.16.1 and 0.19.2 alike) builds one meta tensor per stored tensor with ``torch.empty(size,
**properties.__dict__, device='meta')`` (megatron/core/dist_checkpointing/strategies/torch.py,
``TorchDistLoadShardedStrategy.load_tensors_metadata``), and ``torch.empty`` rejects the new keyword: every load
that reads the checkpoint's tensor list (ours all do: ``extra_state.load_sharded``, the optimizer's key matching)
raises ``TypeError: empty() got an unexpected keyword argument 'strides'``. ``apply()`` gives that one module a view
of torch whose ``empty`` drops ``strides`` (a meta tensor has no storage for strides to lay out); where torch's
TensorProperties has no such field (torch < 2.15) it changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

MODULE = "megatron.core.dist_checkpointing.strategies.torch"


class _TorchWithoutStrides:
    """``torch`` as MODULE sees it: ``empty`` ignores a ``strides`` keyword, everything else is torch."""

    @staticmethod
    @functools.wraps(torch.empty)
    def empty(*args, strides=None, **kwargs):
        return torch.empty(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def tensor_properties_have_strides() -> bool:
    """Whether the installed torch stores ``strides`` in a checkpoint's TensorProperties (torch >= 2.15)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    return "strides" in {field.name for field in dataclasses.fields(TensorProperties)}


def apply() -> None:
    """Give MODULE the torch view where the installed torch needs it; idempotent, for every process that loads."""
    if not tensor_properties_have_strides():
        return
    module = importlib.import_module(MODULE)
    if isinstance(module.torch, _TorchWithoutStrides):
        return
    if module.torch is not torch:  # another layer replaced it: wrapping that one would hide what it does
        raise RuntimeError(f"dcp_metadata_compat: {MODULE} does not use `torch` as expected")
    module.torch = _TorchWithoutStrides()
