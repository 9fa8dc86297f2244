"""The metrics of multi-turn rollouts (``rollout.multi_turn``), from the completions' turn records: what shows a
policy that stops calling its tool (verl #1569: turns collapse to 2), void turns (SimpleTIR: neither a call nor an
answer), tool errors by kind, and how much of the response is tool output.

Names follow verl where verl has one (``num_turns/min|mean|max``; ours counts assistant turns, verl's every message
of the conversation). Rates are per rollout (or per turn) so a step's sampling rounds average to the step's rate.
"""

from __future__ import annotations

from typing import Sequence

from grpo_mega.rollout.base import Completion


def turn_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """``num_turns/*``, ``tools/*`` of multi-turn completions ({} when none has turn records)."""
    rollouts = [c for c in completions if c.turns is not None]
    if not rollouts:
        return {}
    count = len(rollouts)
    turns = [len(c.turns) for c in rollouts]
    all_turns = [t for c in rollouts for t in c.turns]
    calls = [call for t in all_turns for call in t.calls]
    tokens = sum(len(c.response_ids) for c in rollouts)
    tool_tokens = sum(len(c.response_mask) - sum(c.response_mask) for c in rollouts)
    metrics = {
        "num_turns/min": float(min(turns)),
        "num_turns/mean": sum(turns) / count,
        "num_turns/max": float(max(turns)),
        "tools/calls_per_rollout": len(calls) / count,
        # the share of rollouts that called a tool at all: a collapse (the policy stops calling) shows here first
        "tools/call_rate": sum(any(t.calls for t in c.turns) for c in rollouts) / count,
        "tools/error_fraction": sum(call.error is not None for call in calls) / max(len(calls), 1),
        "tools/timeouts_per_rollout": sum(call.error == "timeout" for call in calls) / count,
        "tools/void_turn_fraction": sum(t.ended == "void" for t in all_turns) / max(len(all_turns), 1),
        "tools/max_turns_fraction": sum(c.turns[-1].ended == "max_turns" for c in rollouts if c.turns) / count,
        "tools/output_token_fraction": tool_tokens / max(tokens, 1),
        # the calls' own seconds, summed (they run concurrently: timing_s/tools is the wall clock)
        "tools/call_seconds": sum(call.seconds for call in calls),
    }
    for kind in sorted({call.error for call in calls if call.error is not None}):
        metrics[f"tools/errors/{kind}"] = sum(call.error == kind for call in calls) / count
    rewards = [call.reward for call in calls if call.reward is not None]
    if rewards:
        metrics["tools/reward_mean"] = sum(rewards) / len(rewards)
    return metrics
