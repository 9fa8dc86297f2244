"""Memory per phase of a GRPO step, as metrics, and the hand-off that frees cached blocks before vLLM wakes.

Megatron (training) and vLLM (rollout) share each GPU in turn, so a run's memory is a question per phase: what the
generation phase holds, and what the update holds. :class:`PhaseMemory` records, for each phase,

- ``memory/<phase>/allocated_gib``: memory in live tensors at the end of the phase;
- ``memory/<phase>/reserved_gib``: memory the process holds at the end of the phase (live + cached);
- ``memory/<phase>/peak_gib``: the most held at any moment of the phase (the peak counter is reset at its start);

with ``<phase>`` ``generation`` (the rollout stage: sampling, rewards, PRM scoring) and ``update`` (old / reference
log-probs and the optimizer steps). The figures come from

- CUDA: PyTorch's caching allocator (``torch.cuda.memory_allocated`` / ``memory_reserved`` /
  ``max_memory_allocated`` after ``reset_peak_memory_stats``); vLLM's own allocations (its sleep-mode pool) sit
  outside them, so ``memory/<phase>/device_used_gib`` adds what the whole device has in use (``mem_get_info``);
- CPU: the process's resident memory (psutil). There is no split between live tensors and cached blocks, so
  allocated and reserved are both the resident set at the end of the phase; the peak is Linux's high-water mark of
  the resident set (``VmHWM``), reset at each phase start through ``/proc/self/clear_refs``; where that file is not
  writable, the larger of the resident set at the start and at the end.

Every rank measures its own and the metric is the largest over ranks (an out-of-memory error happens on the
fullest rank). A run whose per-phase figures grow step over step leaks.
"""

from __future__ import annotations

import contextlib
import gc
import re
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

GIB = 2**30
PHASES = ("generation", "update")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def free_cached_memory() -> None:
    """Collect garbage and give PyTorch's cached CUDA blocks back to the driver (no-op for the cache on CPU).

    The caching allocator keeps the blocks freed by an update (activations, logits chunks) for reuse by PyTorch;
    vLLM's wake-up allocates through its own pool, outside that cache, so without this the blocks an update no
    longer needs are still held when vLLM asks for its weights and KV cache (verl does the same before each wake).
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_resident_peak() -> bool:
    """Reset the kernel's resident-set high-water mark of this process (Linux >= 4.0); False where impossible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _resident_peak_bytes() -> int | None:
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PhaseMemory:
    """Measures the memory of named phases on ``device`` (``torch.device``): ``with memory.phase("update"): ...``;
    :meth:`metrics` returns the last figures of every phase measured and forgets them."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._figures: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            start = 0
        else:
            start = _resident_bytes()
            peak_counter = _reset_resident_peak()
        yield
        if on_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            figures = {
                "allocated_gib": torch.cuda.memory_allocated(self.device),
                "reserved_gib": torch.cuda.memory_reserved(self.device),
                "peak_gib": torch.cuda.max_memory_allocated(self.device),
                "device_used_gib": total - free,
            }
        else:
            end = _resident_bytes()
            peak = _resident_peak_bytes() if peak_counter else None
            figures = {"allocated_gib": end, "reserved_gib": end,
                       "peak_gib": max(peak, end) if peak is not None else max(start, end)}
        for key, value in figures.items():
            self._figures[f"memory/{name}/{key}"] = value / GIB

    def metrics(self) -> dict[str, float]:
        """``memory/<phase>/<figure>`` in GiB, the largest over the ranks of the job when torch.distributed is up
        (collective then: every rank calls it after the same phases)."""
        figures, self._figures = self._figures, {}
        if not figures or not dist.is_initialized():
            return figures
        names = sorted(figures)
        values = torch.tensor([figures[n] for n in names], dtype=torch.float64,
                              device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return dict(zip(names, values.tolist()))
