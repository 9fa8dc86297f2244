"""A multi-turn rollout as the message list TRL's reward functions read: with ``tools``, TRL's ``GRPOTrainer`` gives a
conversational dataset's reward functions each completion as its messages, the assistant's turns and a
``{"role": "tool", "name": ..., "content": ...}`` message per call between them.

From the token stream (``grpo_mega.rollout.turn_loop``), never re-parsed from text: each turn's text is the decode of
its own policy tokens (``TurnRecord.start:end``); a turn that made a hermes call keeps the text before
``<tool_call>`` as its ``content`` and the call as ``tool_calls`` (``{"type": "function", "function": {"name",
"arguments"}}``, the form chat templates take), a call that did not parse stays in the text; each call whose tool
turn was appended gets its ``tool`` message with what the policy was shown (``ToolCallRecord.content``: the output,
cut as the policy saw it, or the error message). A call that was not run (the ``max_turns``-th turn's) or whose tool
turn had no room left is not followed by a ``tool`` message: the policy never saw one. The rollout stage gives them
to the reward functions under ``grpo_mega.reward.adapters.TRAJECTORY_MESSAGES``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from grpo_mega.rollout.base import Completion

CALL_OPEN = "<tool_call>"


def trajectory_messages(completion: Completion, decode: Callable[[Sequence[int]], str]) -> list[dict]:
    """The messages of ``completion`` (see the module docstring); a completion without turn records is one
    assistant message of its text."""
    if completion.turns is None:
        return [{"role": "assistant", "content": completion.text}]
    messages: list[dict] = []
    for turn in completion.turns:
        text = decode(completion.response_ids[turn.start:turn.end])
        parsed = [call for call in turn.calls if call.name]
        message = {"role": "assistant", "content": text}
        if parsed and CALL_OPEN in text:
            message["content"] = text[:text.rfind(CALL_OPEN)]
            message["tool_calls"] = [{"type": "function", "function": {"name": call.name,
                                                                       "arguments": dict(call.arguments)}}
                                     for call in parsed]
        messages.append(message)
        if turn.tool_end is not None:
            messages += [{"role": "tool", **({"name": call.name} if call.name else {}), "content": call.content}
                         for call in turn.calls]
    return messages
