"""What crosses between the training world and the rollout world in ``rollout.mode: async``, and how.

Two ordered streams over the bridge (``grpo_mega.parallel.roles``: a two-rank gloo group of the worlds' rank 0s):

- trainer -> rollout: ``start`` (where the rollout side begins: the first step it generates, the prompt sampler's
  state), ``weights`` (a version of the policy: HF-named full tensors in buckets), ``stop``;
- rollout -> trainer: ``batch`` (one step's scored and filtered rollout batch, with its metrics and the weights
  version that generated it), ``eval`` (the evaluation of a weights version), ``bye``.

Every message is a header (kind, byte count) and a pickled payload; a weights bucket's tensors follow its own
message as one byte buffer, so neither side pickles tensors or holds the model twice in flight per version. Sends
are asynchronous (gloo ``send`` returns at once): the sender keeps each message's buffers until :meth:`settle`
says the receiver has taken it, which the schedule of ``grpo_mega.stages.rollout_feed`` /
``grpo_mega.rollout_worker`` proves without waiting (a version the trainer pushed is received before the batch it
generates is sent, and so on). Inside each world rank 0 relays what it receives to its other ranks
(:func:`share_in_world`), so every rank of a world sees the same stream.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo_mega.rollout.weight_sync import iter_buckets, tensor_bytes

KINDS = ("start", "weights", "bucket", "weights_end", "stop", "batch", "eval", "bye")
_ALIGN = 16  # each tensor's bytes start on a 16-byte boundary of its bucket, so that any dtype can view them


@dataclass(frozen=True)
class TransferStats:
    """One weights version sent (trainer) or received (rollout side)."""

    seconds: float
    bytes: int
    num_tensors: int
    num_buckets: int


class Bridge:
    """One end of the bridge: ``send`` / ``receive`` ordered messages to and from the other end."""

    def __init__(self, group: dist.ProcessGroup, *, is_trainer: bool):
        self.group = group
        self.peer = 1 if is_trainer else 0
        # one tag per direction: the two streams never match each other's receives
        self.send_tag, self.receive_tag = (0, 1) if is_trainer else (1, 0)
        self._pending: list[tuple[int, list[Any]]] = []  # (key, [work, ... buffers kept alive])

    # ------------------------------------------------------------------ messages
    def send(self, kind: str, payload: Any = None, *, key: int = 0) -> None:
        """Queue one message; returns at once. ``key`` orders :meth:`settle` (a step or a version)."""
        if kind not in KINDS:
            raise ValueError(f"unknown bridge message kind {kind!r}")
        data = torch.frombuffer(bytearray(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)),
                                dtype=torch.uint8)
        self._send_raw(data, key)

    def receive(self) -> tuple[str, Any]:
        """The next message from the other end (blocks; bounded by the group's timeout)."""
        return pickle.loads(self._receive_raw().numpy().tobytes())

    def settle(self, up_to_key: int | None = None) -> None:
        """Wait until the messages queued with ``key <= up_to_key`` (all of them: None) are taken, and drop their
        buffers."""
        keep = []
        for key, held in self._pending:
            if up_to_key is None or key <= up_to_key:
                held[0].wait()
            else:
                keep.append((key, held))
        self._pending = keep

    def pending_keys(self) -> set[int]:
        """The keys of the messages queued and not yet settled (e.g. the weights versions in flight)."""
        return {key for key, _ in self._pending}

    # ------------------------------------------------------------------ weights
    def send_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     bucket_bytes: int) -> TransferStats:
        """Queue one weights version: ``weights``, then per bucket its names / dtypes / shapes and one byte buffer
        (the tensors copied to host memory), then ``weights_end``. Returns once every bucket is queued."""
        start = time.perf_counter()
        self.send("weights", {"version": version}, key=version)
        total = tensors = buckets = 0
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            entries, buffer = pack_bucket(bucket)
            self.send("bucket", entries, key=version)
            self._send_raw(buffer, version)
            total += sum(tensor_bytes(t) for _, t in bucket)
            tensors, buckets = tensors + len(bucket), buckets + 1
        self.send("weights_end", {"version": version, "tensors": tensors}, key=version)
        return TransferStats(time.perf_counter() - start, total, tensors, buckets)

    def receive_bucket(self, entries: list[tuple[str, str, tuple[int, ...], int, int]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors of the ``bucket`` message whose ``entries`` were just received."""
        return unpack_bucket(entries, self._receive_raw())

    # ------------------------------------------------------------------ raw
    def _send_raw(self, data: torch.Tensor, key: int) -> None:
        header = torch.tensor([data.numel()], dtype=torch.int64)
        for tensor in (header, data):
            work = self.group.send([tensor], self.peer, self.send_tag)
            self._pending.append((key, [work, tensor]))

    def _receive_raw(self) -> torch.Tensor:
        header = torch.zeros(1, dtype=torch.int64)
        self.group.recv([header], self.peer, self.receive_tag).wait()
        data = torch.empty(int(header[0]), dtype=torch.uint8)
        self.group.recv([data], self.peer, self.receive_tag).wait()
        return data


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list, torch.Tensor]:
    """(entries, buffer): each tensor's bytes in one host buffer, each at a 16-byte-aligned offset; an entry is
    (name, dtype name, shape, offset, byte count)."""
    entries, offset = [], 0
    for name, tensor in bucket:
        size = tensor_bytes(tensor)
        entries.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, size))
        offset += -(-size // _ALIGN) * _ALIGN
    buffer = torch.zeros(offset, dtype=torch.uint8)
    for (name, tensor), (_, _, _, start, size) in zip(bucket, entries):
        if size:
            buffer[start:start + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return entries, buffer


def unpack_bucket(entries, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a packed bucket (views of ``buffer``)."""
    tensors = []
    for name, dtype, shape, start, size in entries:
        tensors.append((name, buffer[start:start + size].view(getattr(torch, dtype)).reshape(shape)))
    return tensors


def share_in_world(value: Any, *, source_has_it: bool) -> Any:
    """``value`` from the world's rank 0 on every rank of the world (a no-op in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value if source_has_it else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def share_tensors_in_world(named: list[tuple[str, torch.Tensor]] | None, entries, device: torch.device
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """A received bucket's tensors on every rank of the world, on ``device`` (broadcast from rank 0, one tensor at
    a time; rank 0 passes the tensors, the others None)."""
    many = dist.is_initialized() and dist.get_world_size() > 1
    for index, (name, dtype, shape, _, _) in enumerate(entries):
        if named is not None:
            tensor = named[index][1].to(device)
        else:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        if many:
            dist.broadcast(tensor, src=0)
        yield name, tensor
