"""``rollout.multi_turn``: rollouts in which the policy calls tools (``grpo_mega.rollout.turn_loop``) and the
sandbox those tools run in (``grpo_mega.tools``). docs/training.md, "Tools and multi-turn rollouts"."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MultiTurnSandboxConfig:
    """The limits of one tool call in the sandbox (``grpo_mega.tools.SandboxConfig``, field for field)."""

    timeout_s: float = 10.0
    """Wall-clock seconds a call may run; past it the call is killed and the policy sees a timeout message."""
    cpu_time_s: float = 10.0
    """CPU seconds a call may use (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space of a call, MiB (RLIMIT_AS)."""
    file_size_mb: int = 16
    """Largest file a call may write, MiB (RLIMIT_FSIZE)."""
    max_processes: int = 16
    """Processes and threads a call may create."""
    max_output_bytes: int = 8192
    """Bytes of stdout + stderr kept per call (the rest is cut, and the cut said)."""
    workers: int = 4
    """Pre-started worker processes in the pool (per rollout rank)."""
    network: bool = False
    """False: calls get no network (a network namespace where the kernel allows it)."""
    seed: int = 0
    """Seeds ``random`` / numpy inside each call, so a tool's output is a function of its input (exact resume)."""


@dataclass
class MultiTurnConfig:
    """Multi-turn tool rollouts: the policy's turns alternate with tool turns (verl's ``rollout.multi_turn``; the
    mapping of verl's and TRL's keys is in docs/migrating.md). The tool turns' tokens are in the response but get
    loss mask 0 (no loss, KL, entropy or advantage)."""

    enable: bool = False
    """Run the turn loop (``grpo_mega.rollout.turn_loop``): generate until a tool call, run it, append the tool's
    turn, continue. False: one completion per sample, no tools."""
    max_turns: int = 4
    """Most assistant turns per rollout (verl's ``max_assistant_turns``); a call made in the last one is not run
    (the rollout ends there: ``tools/max_turns_fraction``)."""
    max_tokens_per_turn: int = 0
    """Most tokens the policy writes per turn; 0 = the response budget (``algorithm.response_length``, which
    counts the whole response, tool turns included)."""
    max_tool_response_tokens: int = 256
    """A tool's output is cut to this many tokens (verl's ``max_tool_response_length``), the cut said in the text."""
    tool_response_truncate_side: str = "middle"
    """Which part of a too-long output is cut away: ``left`` (keep the end), ``right`` (keep the start), ``middle``
    (keep both ends; verl's default)."""
    format: str = "hermes"
    """How the policy calls a tool: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen2.5 /
    Qwen3; the output comes back as the chat template's ``tool`` message, or ``<tool_response>...</tool_response>``
    without a chat template) or ``code`` (ToRL: a ```` ```python ```` block then ```` ```output ```` runs on the
    ``python`` tool; the output is appended as the block's content)."""
    tools: list[str] = field(default_factory=list)
    """The tools the policy may call: ``python``, ``calculator``, or a user function ``path/to/file.py:function`` /
    ``package.module:function`` (its JSON schema from its signature and docstring). Checked before launch."""
    sandbox: MultiTurnSandboxConfig = field(default_factory=MultiTurnSandboxConfig)
