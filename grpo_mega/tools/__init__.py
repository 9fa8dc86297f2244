"""Tools a policy calls during multi-turn rollouts, run in a sandbox (issue 75; docs/clusters.md, "The tool sandbox").

``build_toolset(specs, SandboxConfig(...))`` gives a :class:`ToolSet`: ``names``, ``schemas()`` for the chat
template's ``tools=``, ``run(calls)`` (concurrent, never raising for a bad call: errors become ToolResults with an
error kind) and ``close()``. ``check_tool_specs(specs)`` checks specs before launch and ``tool_schemas(specs)``
gives their schemas, neither starting a process.
Importing this package does not import torch (nor transformers: user tools' schemas import it when built).

It may import ``reward`` (user tools are resolved like user reward functions) and the layers below; ``rollout``'s
turn loop and the config import it.
"""

from grpo_mega.tools.base import TOOL_ERROR_KINDS, SandboxConfig, ToolCall, ToolResult
from grpo_mega.tools.toolset import ToolSet, build_toolset, check_tool_specs, tool_schemas

__all__ = ["TOOL_ERROR_KINDS", "SandboxConfig", "ToolCall", "ToolResult", "ToolSet", "build_toolset",
           "check_tool_specs", "tool_schemas"]
