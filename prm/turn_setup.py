"""The turn loop ``grpo-mega prm label --steps turns`` samples and continues rollouts with: the policy's own
``rollout.multi_turn`` (a grpo-mega checkpoint's saved config, when it enables the loop) under the command's flags
(``--tools``, ``--tool-format``, ``--max-turns``, ``--max-tokens-per-turn``, ``--max-tool-response-tokens``), the
response budget ``--max-new-tokens`` (the whole response, tool turns included, as ``algorithm.response_length``)."""

from __future__ import annotations

import argparse
import dataclasses

from grpo_mega.config.multi_turn import MultiTurnConfig, MultiTurnSandboxConfig

STEP_KINDS = ("text", "turns")
"""``--steps``: ``text`` splits each solution's text by ``--step-pattern``; ``turns`` makes each assistant turn of
a multi-turn tool rollout a step (``prm.turn_steps``)."""


def add_turn_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``prm label`` that choose turns as steps and the turn loop's settings."""
    parser.add_argument("--steps", choices=STEP_KINDS, default=None, help="what a step is: text (split by "
                        "--step-pattern) or turns (each assistant turn of a multi-turn tool rollout, sampled and "
                        "continued through the turn loop; docs/prm.md, 'PRMs on turns'); default: the policy "
                        "checkpoint's process_reward.steps, else text")
    parser.add_argument("--tools", default=None, help="--steps turns: the tools, comma-separated (calculator, "
                        "python, path/to/file.py:function), as rollout.multi_turn.tools (default: the policy "
                        "checkpoint's rollout.multi_turn.tools)")
    parser.add_argument("--tool-format", choices=("hermes", "code"), default=None,
                        help="--steps turns: rollout.multi_turn.format (default: the policy's, else hermes)")
    parser.add_argument("--max-turns", type=int, default=None, help="--steps turns: rollout.multi_turn.max_turns "
                        "(default: the policy's, else 4)")
    parser.add_argument("--max-tokens-per-turn", type=int, default=None,
                        help="--steps turns: rollout.multi_turn.max_tokens_per_turn (0: the response budget)")
    parser.add_argument("--max-tool-response-tokens", type=int, default=None,
                        help="--steps turns: rollout.multi_turn.max_tool_response_tokens (default: the policy's, "
                        "else 256)")


def step_kind_of(args: argparse.Namespace, run_config: dict | None) -> str:
    """``--steps``, else the policy checkpoint's ``process_reward.steps`` (a GRPO run trained with turn credit),
    else ``text``."""
    if args.steps is not None:
        return args.steps
    saved = ((run_config or {}).get("process_reward") or {}).get("steps")
    return saved if saved in STEP_KINDS else "text"


def multi_turn_settings(args: argparse.Namespace, run_config: dict | None) -> MultiTurnConfig:
    """The policy checkpoint's ``rollout.multi_turn`` when it enables the loop (else the defaults), under the
    command's flags; ValueError naming the flag when no tool is given or a number is out of range."""
    saved = dict(((run_config or {}).get("rollout") or {}).get("multi_turn") or {})
    settings = MultiTurnConfig()
    if saved.get("enable"):
        sandbox = MultiTurnSandboxConfig(**(saved.pop("sandbox", None) or {}))
        known = {f.name for f in dataclasses.fields(MultiTurnConfig)}
        settings = MultiTurnConfig(**{k: v for k, v in saved.items() if k in known}, sandbox=sandbox)
    changes = {"enable": True}
    if args.tools is not None:
        changes["tools"] = [spec.strip() for spec in args.tools.split(",") if spec.strip()]
    for flag, key in (("tool_format", "format"), ("max_turns", "max_turns"),
                      ("max_tokens_per_turn", "max_tokens_per_turn"),
                      ("max_tool_response_tokens", "max_tool_response_tokens")):
        if getattr(args, flag) is not None:
            changes[key] = getattr(args, flag)
    settings = dataclasses.replace(settings, **changes)
    if not settings.tools:
        raise ValueError("--steps turns needs tools: pass --tools (e.g. --tools calculator), or a --policy "
                         "checkpoint whose config enables rollout.multi_turn with its tools")
    for flag, value, low in (("--max-turns", settings.max_turns, 1), ("--max-tokens-per-turn",
                             settings.max_tokens_per_turn, 0),
                             ("--max-tool-response-tokens", settings.max_tool_response_tokens, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    return settings


def build_turn_loop(engine, tokenizer, settings: MultiTurnConfig, toolset, *, max_response_tokens: int,
                    use_chat_template: bool):
    """``engine`` wrapped in the turn loop with ``toolset`` (``grpo_mega.rollout.turn_loop.TurnLoopEngine``), as
    the trainer wraps its rollout engine (``grpo_mega.stages.rollout_setup.with_turn_loop``)."""
    from grpo_mega.rollout.tool_turns import tool_turns_for
    from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings

    loop_settings = TurnLoopSettings(
        max_response_tokens=max_response_tokens, max_turns=settings.max_turns,
        max_tokens_per_turn=settings.max_tokens_per_turn or None,
        max_tool_response_tokens=settings.max_tool_response_tokens,
        tool_response_truncate_side=settings.tool_response_truncate_side, format=settings.format)
    tool_turns = tool_turns_for(settings.format, tokenizer, use_chat_template=use_chat_template)
    return TurnLoopEngine(engine, toolset, tokenizer, loop_settings, tool_turns)


def build_toolset_of(settings: MultiTurnConfig):
    """The tools of ``settings`` with their sandbox (``grpo_mega.tools.build_toolset``)."""
    from grpo_mega.tools import SandboxConfig, build_toolset

    return build_toolset(list(settings.tools), SandboxConfig(**dataclasses.asdict(settings.sandbox)))
