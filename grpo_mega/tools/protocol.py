"""Frames between the pool (in the trainer) and a worker: a 4-byte big-endian length, then that many bytes of JSON."""

from __future__ import annotations

import json
import os
import struct
from typing import Any


def send(fd: int, message: Any) -> None:
    data = json.dumps(message).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int) -> Any | None:
    """The next message, or None at the end of the stream (the other side is gone)."""
    header = _read_exactly(fd, 4)
    if header is None:
        return None
    body = _read_exactly(fd, struct.unpack(">I", header)[0])
    return None if body is None else json.loads(body)
