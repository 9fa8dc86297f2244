"""What a tool call is, what it returns, and the limits every call runs under (the interface the turn loop uses).

Error kinds of :class:`ToolResult` (``TOOL_ERROR_KINDS``):

- ``invalid_call``: text that is not a valid call (made by the turn loop's parser, never here);
- ``unknown_tool``: a name that is not in the tool set;
- ``bad_arguments``: arguments missing, unexpected or of the wrong JSON type, or an expression the calculator does
  not accept;
- ``exception``: the code or the tool raised (the content ends with the exception's last line);
- ``timeout``: the call ran past ``SandboxConfig.timeout_s`` (killed with everything it started);
- ``memory``: the call ran out of its address space (``SandboxConfig.memory_mb``: a ``MemoryError``);
- ``output_limit``: the call printed more than ``HARD_OUTPUT_BYTES`` and was stopped (below that the output is
  only cut to ``SandboxConfig.max_output_bytes``, not an error);
- ``crashed``: the call's process died without an answer (a segfault, ``os._exit``, a signal, a dead worker);
- ``cpu_time``: the call used its CPU seconds (``SandboxConfig.cpu_time_s``: SIGXCPU);
- ``file_size``: the call wrote a file larger than ``SandboxConfig.file_size_mb``;
- ``processes``: the call could not start a process or thread (``SandboxConfig.max_processes`` reached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOOL_ERROR_KINDS = ("invalid_call", "unknown_tool", "bad_arguments", "exception", "timeout", "memory",
                    "output_limit", "crashed", "cpu_time", "file_size", "processes")

# Output past this many bytes stops the call (error "output_limit"): a program that prints a gigabyte would
# otherwise keep a worker busy until its timeout only to have all but max_output_bytes thrown away.
HARD_OUTPUT_BYTES = 1 << 20


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote: the tool's name and its parsed JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ToolResult:
    """What a call gave back.

    ``content`` is what the policy sees (already cut to the sandbox's output limit; on an error a short message
    it can act on, such as the last line of a traceback or "timed out after 10 s"); ``error`` is None or one of
    ``TOOL_ERROR_KINDS``; ``seconds`` the call's wall-clock; ``reward`` the tool's own reward for its turn
    (verl's ``tool_reward_score``), None when the tool gives none.
    """

    content: str
    error: str | None = None
    seconds: float = 0.0
    reward: float | None = None


@dataclass
class SandboxConfig:
    """The limits of one tool call in the sandbox (docs/clusters.md, "The tool sandbox")."""

    timeout_s: float = 10.0
    """Wall-clock seconds per call; past it the call and every process it started are killed (error "timeout")."""
    cpu_time_s: float = 10.0
    """CPU seconds per call (RLIMIT_CPU; error "cpu_time")."""
    memory_mb: int = 1024
    """Address space of the call's process in MiB (RLIMIT_AS; error "memory"). Per process: a call that starts
    processes may use up to max_processes times this."""
    file_size_mb: int = 16
    """Largest file the call may write, in MiB (RLIMIT_FSIZE; error "file_size"); also sizes the call's private
    /tmp (4 times this)."""
    max_processes: int = 16
    """Processes and threads the call may have at once, itself included (RLIMIT_NPROC under a user id of its own
    when the sandbox runs as root; error "processes")."""
    max_output_bytes: int = 8192
    """Bytes of stdout+stderr (or of a user tool's answer) the policy sees; the rest is cut and the cut said."""
    workers: int = 4
    """Pre-started worker processes in the pool: how many calls run at once."""
    network: bool = False
    """False: no network for the calls (a network namespace with no interface up, where the kernel allows)."""
    seed: int = 0
    """Seeds random (and numpy when installed) before each call and is the workers' PYTHONHASHSEED, so an output
    is a function of the input."""

    def __post_init__(self):
        for name in ("timeout_s", "cpu_time_s", "memory_mb", "file_size_mb", "max_processes", "max_output_bytes",
                     "workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
