"""A run's tools: the built-in ``python`` and ``calculator`` and user tools by spec, behind one ``run`` that never
raises for a bad call (the interface of docs/training.md's turn loop)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from grpo_mega.tools.base import SandboxConfig, ToolCall, ToolResult
from grpo_mega.tools.calculator import CALCULATOR_SCHEMA, CalculatorError, calculate
from grpo_mega.tools.python_tool import PYTHON_SCHEMA, error_line
from grpo_mega.tools.user_tools import BadArguments, UserTool, call_arguments, load_user_tool

BUILTIN_TOOLS = {"python": PYTHON_SCHEMA, "calculator": CALCULATOR_SCHEMA}


def _load_specs(specs: Sequence[str]) -> dict[str, UserTool | None]:
    """name -> the user tool (None for a built-in), checking every spec; ValueError with one line on the first bad
    one."""
    tools: dict[str, UserTool | None] = {}
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"tool spec {spec!r}: expected 'python', 'calculator', 'path/to/file.py:function' or "
                             "'package.module:function'")
        if spec in BUILTIN_TOOLS:
            name, tool = spec, None
        elif ":" not in spec:
            raise ValueError(f"unknown tool {spec!r}: use one of {sorted(BUILTIN_TOOLS)}, 'path/to/file.py:function' "
                             "or 'package.module:function'")
        else:
            tool = load_user_tool(spec)
            name = tool.name
        if name in tools:
            raise ValueError(f"tool spec {spec!r}: a second tool named {name!r} (tool names must differ)")
        tools[name] = tool
    return tools


def tool_schemas(specs: Sequence[str]) -> list[dict]:
    """The schemas of the tools of ``specs`` (as ``ToolSet.schemas``) without starting any process: what a process
    that renders prompts but runs no tool needs (async mode's training ranks)."""
    return [BUILTIN_TOOLS[name] if tool is None else tool.schema for name, tool in _load_specs(specs).items()]


def check_tool_specs(specs: Sequence[str]) -> None:
    """Raises ValueError with one line naming the bad spec (a typo, a module that does not import, no such function,
    not callable, a schema that cannot be built), without starting any process: the check before launch."""
    _load_specs(specs)


class ToolSet:
    """The tools a policy may call, and the sandbox pool that runs them (closed by ``close`` or ``with``)."""

    def __init__(self, tools: dict[str, UserTool | None], sandbox: SandboxConfig):
        self.names: list[str] = list(tools)
        self.sandbox = sandbox
        self._tools = tools
        self._pool = None
        self._executor = None
        # the built-in calculator runs inline: no pool for it alone (a user tool named "calculator" needs one)
        if any(tool is not None or name != "calculator" for name, tool in tools.items()):
            from grpo_mega.tools.pool import WorkerPool
            self._pool = WorkerPool(sandbox, {name: tool.spec for name, tool in tools.items() if tool is not None})
            self._executor = ThreadPoolExecutor(sandbox.workers, thread_name_prefix="sandbox-call")
        self._close_lock = threading.Lock()

    @property
    def isolation(self) -> dict:
        """What the kernel allowed the workers (network namespace, user id of the calls); {} without a pool."""
        return dict(self._pool.info) if self._pool is not None else {}

    def schemas(self) -> list[dict]:
        """The tools' schemas for ``tokenizer.apply_chat_template(tools=...)``, in the order of the specs."""
        return [BUILTIN_TOOLS[name] if tool is None else tool.schema for name, tool in self._tools.items()]

    def run(self, calls: Sequence[ToolCall], kwargs: Sequence[Mapping[str, Any]] | None = None) -> list[ToolResult]:
        """Runs the calls concurrently on the pool, results in call order. ``kwargs[i]``: the row's per-tool
        keyword arguments for call i's tool (verl's ``extra_info.tools_kwargs[name]``, its create/execute groups
        merged), given to user tools that accept them. Never raises for a bad call."""
        if kwargs is not None and len(kwargs) != len(calls):
            raise ValueError(f"ToolSet.run: {len(kwargs)} kwargs for {len(calls)} calls")
        rows = list(kwargs) if kwargs is not None else [None] * len(calls)
        if self._executor is None or len(calls) <= 1:
            return [self._run_one(call, row) for call, row in zip(calls, rows)]
        return list(self._executor.map(self._run_one, calls, rows))

    def _run_one(self, call: ToolCall, row_kwargs: Mapping[str, Any] | None) -> ToolResult:
        started = time.monotonic()
        result = self._dispatch(call, row_kwargs)
        result.seconds = time.monotonic() - started
        return result

    def _dispatch(self, call: ToolCall, row_kwargs: Mapping[str, Any] | None) -> ToolResult:
        if call.name not in self._tools:
            return ToolResult(f"unknown tool {call.name!r}: the tools are {', '.join(self.names)}", "unknown_tool")
        arguments = call.arguments
        tool = self._tools[call.name]
        if tool is not None:
            try:
                request = {"tool": "user", "name": call.name, "arguments": call_arguments(tool, arguments, row_kwargs)}
            except BadArguments as error:
                return ToolResult(str(error), "bad_arguments")
        else:
            key = "code" if call.name == "python" else "expression"
            if not isinstance(arguments, Mapping) or set(arguments) != {key} or not isinstance(arguments[key], str):
                return ToolResult(f"{call.name} takes one argument, {key!r} (a string)", "bad_arguments")
            if call.name == "calculator":
                return _calculate(arguments[key])
            request = {"tool": "python", "code": arguments[key]}
        try:
            answer = self._pool.call(request)
        except (TypeError, ValueError) as error:  # arguments that are not JSON (the turn loop parsed them: rare)
            return ToolResult(f"arguments that are not JSON cannot be sent to the tool: {error}", "bad_arguments")
        return ToolResult(answer.get("content", ""), answer.get("error"), reward=answer.get("reward"))

    def close(self) -> None:
        """Stops the pool; no process is left behind."""
        with self._close_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> "ToolSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _calculate(expression: str) -> ToolResult:
    try:
        return ToolResult(calculate(expression))
    except CalculatorError as error:
        return ToolResult(f"calculator: {error}", "bad_arguments")
    except ZeroDivisionError as error:
        return ToolResult(error_line(error), "exception")


def build_toolset(specs: Sequence[str], sandbox: SandboxConfig) -> ToolSet:
    """The tool set of ``specs`` (``"python"``, ``"calculator"``, ``"path/to/file.py:function"``,
    ``"package.module:function"``) with its worker pool started (none when the calculator is the only tool).
    Raises ValueError with one line for a bad spec."""
    return ToolSet(_load_specs(specs), sandbox)
