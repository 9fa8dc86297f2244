"""Sending side of weight sync: stream (HF name, full tensor) pairs into a rollout engine in bounded buckets.

The source is an iterator over the trainer's weights already gathered across TP/PP ranks, one tensor at a time,
so neither side ever holds the whole model twice: at most one bucket is in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from grpo_mega.rollout.base import RolloutEngine


@dataclass(frozen=True)
class SyncStats:
    """What one weight sync moved, and how long it took."""

    seconds: float
    """Wall time from begin_weight_update to the end of finish_weight_update (includes producing the tensors)."""
    bytes: int
    """Sum of the tensors' sizes as sent (numel x element size)."""
    num_tensors: int
    num_buckets: int

    @property
    def gib_per_second(self) -> float:
        """Throughput in GiB/s (0 for an instantaneous sync)."""
        return self.bytes / 2**30 / self.seconds if self.seconds > 0 else 0.0


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Size of ``tensor``'s elements in bytes."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive (name, tensor) pairs into lists whose total size is at most ``bucket_bytes``.

    Order is kept. A tensor larger than ``bucket_bytes`` goes alone in its own bucket. Pulls from the source
    lazily: a bucket is yielded as soon as the next tensor would overflow it.
    """
    if bucket_bytes < 1:
        raise ValueError(f"iter_buckets: bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    filled = 0
    for name, tensor in named_tensors:
        size = tensor_bytes(tensor)
        if bucket and filled + size > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += size
    if bucket:
        yield bucket


def sync_weights(
    source: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine, bucket_bytes: int
) -> SyncStats:
    """Stream every tensor of ``source`` into ``engine`` between begin_weight_update and finish_weight_update.

    ``finish_weight_update`` checks completeness (the hf engine raises when a parameter did not arrive). A
    failure while streaming propagates; the engine then stays in its update and refuses to generate until the
    next complete sync.
    """
    start = time.perf_counter()
    total_bytes = num_tensors = num_buckets = 0
    engine.begin_weight_update()
    for bucket in iter_buckets(source, bucket_bytes):
        engine.update_weights(bucket)
        total_bytes += sum(tensor_bytes(t) for _, t in bucket)
        num_tensors += len(bucket)
        num_buckets += 1
    engine.finish_weight_update()
    return SyncStats(time.perf_counter() - start, total_bytes, num_tensors, num_buckets)
