"""Counting the operations that make the host wait for the device (host syncs), on any device.

On a GPU, reading a device value on the host waits for every kernel queued before it, and the GPU then idles while
Python launches the next ones: a decode step of a small model is launch-bound, so one read per step can double it.
These operations reach the host (torch's dispatcher names; ``.item()``, ``bool(tensor)``, ``int(tensor)`` and
``.tolist()`` of a device tensor all end in the first or the last):

- ``aten._local_scalar_dense``: one value to the host;
- ``aten.nonzero`` (and boolean-mask indexing, which calls it): the result's size is data-dependent;
- a copy to the CPU: ``aten._to_copy`` with ``device=cpu`` or ``aten.copy_`` into a CPU tensor from another device.

Under ``torch.inference_mode`` torch does not show ``item`` / ``_to_copy`` to a dispatch mode (it does under
``torch.no_grad``): count code that runs in inference mode with ``inference_mode`` replaced by ``no_grad``.

On the CPU none of them waits, but they are dispatched the same, so :class:`HostSyncCounter` run around CPU code
counts the reads the same code makes on CUDA (the copy to the CPU is counted when explicitly asked for with
``device="cpu"``, as ``grpo_mega.rollout.hf_decode.to_host`` does: on the CPU ``tensor.cpu()`` is no operation at
all). Used by tests/test_rollout_hf_decode_syncs.py and bench/gpu_check_decode.py.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.nonzero_static.default"}
_SORTS = {"aten.sort.default", "aten.sort.stable", "aten.sort.values", "aten.sort.values_stable",
          "aten.topk.default", "aten.kthvalue.default", "aten.argsort.default", "aten.argsort.stable",
          "aten.msort.default"}


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as counter: ...`` then ``counter.syncs`` (host reads, by op in ``counter.by_op``)
    and ``counter.sorts``: (op, size of the sorted dimension, k for top-k) of every sort / top-k / kthvalue."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.sorts: list[tuple[str, int, int | None]] = []

    @property
    def syncs(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in _SCALAR_READS:
            self.by_op[name] += 1
        elif name == "aten._to_copy.default" and _is_cpu(kwargs.get("device")) and (
                args[0].device.type != "cpu" or kwargs.get("dtype", args[0].dtype) == args[0].dtype):
            # to the CPU from a device, or an explicit same-dtype copy to the CPU of a CPU tensor (what moves data
            # to the host on CUDA; a dtype conversion ``.to(device=x.device, dtype=...)`` on the CPU is not one)
            self.by_op["device-to-host copy"] += 1
        elif name.startswith("aten.copy_") and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.by_op["device-to-host copy"] += 1
        elif name in _SORTS:
            tensor = args[0]
            dim = args[2] if name.startswith("aten.topk") and len(args) > 2 else kwargs.get("dim", -1)
            if name.startswith("aten.sort") or name.startswith("aten.argsort"):
                dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
            k = args[1] if name.startswith(("aten.topk", "aten.kthvalue")) else None
            self.sorts.append((name, tensor.shape[dim] if tensor.dim() else 1, k))
        return func(*args, **kwargs)
