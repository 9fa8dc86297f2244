"""A multi-turn rollout as TRL's reward functions read it (``grpo_mega.rollout.turn_messages``): the assistant's turns
and a ``role: tool`` message after each call, from the token stream the turn loop kept; and the TRL adapter giving
those messages as ``completions`` of conversational rows (the text otherwise), never as a column. The turn loop runs
over test_turn_loop.py's scripted engine and in-test calculator."""

from __future__ import annotations

from grpo_mega.reward.adapters import TRAJECTORY_MESSAGES, RewardRows, adapt
from grpo_mega.rollout.base import Completion
from grpo_mega.rollout.turn_messages import trajectory_messages
from test_turn_loop import CALL, run, tokenizer, two_turns  # noqa: F401  (tokenizer: the module's fixture)


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_a_two_turn_rollout_is_an_assistant_call_its_tool_message_and_the_answer(tokenizer):
    completions, *_ = run(tokenizer, two_turns)
    for row, c in enumerate(completions):
        value = 3 * (c.prompt_index + 1) * (row % 2 + 2)
        expression = f"3 * {c.prompt_index + 1} * {row % 2 + 2}"
        assert trajectory_messages(c, _decode(tokenizer)) == [
            {"role": "assistant", "content": "I will compute. ",
             "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                              "arguments": {"expression": expression}}}]},
            {"role": "tool", "name": "calculator", "content": str(value)},
            {"role": "assistant", "content": f"The answer is {value}."},
        ]


def test_an_invalid_call_keeps_its_text_and_a_call_never_run_gets_no_tool_message(tokenizer):
    def script(prompt, sample, turn, prefix):
        if turn == 0:
            return "<tool_call>{not json}</tool_call>" if sample == 0 else CALL % "1 + 1"
        return CALL % "2 + 2"  # the second (last) turn's call is not run: max_turns=2

    (bad, last), *_ = run(tokenizer, script, prompts=1, max_turns=2)
    messages = trajectory_messages(bad, _decode(tokenizer))
    assert messages[0] == {"role": "assistant", "content": "<tool_call>{not json}</tool_call>"}
    assert messages[1]["role"] == "tool" and "name" not in messages[1] and "not valid JSON" in messages[1]["content"]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]  # the max_turns call: no tool message
    assert [m["role"] for m in trajectory_messages(last, _decode(tokenizer))] == ["assistant", "tool", "assistant"]
    single = Completion(0, [1], [5, 6], [-1.0, -1.0], "The answer is 4.", "eos")
    assert trajectory_messages(single, _decode(tokenizer)) == [{"role": "assistant", "content": "The answer is 4."}]


def test_a_trl_reward_gets_the_messages_of_conversational_rows_and_the_text_otherwise(tokenizer):
    completions, *_ = run(tokenizer, two_turns, prompts=1)
    seen = []

    def tool_used(completions, prompts, solution, **kwargs):
        """TRL's form: 1 where the tool's message holds the answer the last assistant turn gives."""
        seen.append((completions, sorted(kwargs)))
        return [float(isinstance(c, list) and len(c) > 2 and c[-2]["role"] == "tool"
                      and c[-2]["content"] in c[-1]["content"])
                for c in completions]

    extras = [{"solution": "12", TRAJECTORY_MESSAGES: trajectory_messages(c, _decode(tokenizer))} for c in completions]
    texts = [c.text for c in completions]
    conversational = adapt(tool_used, "rewards.py:tool_used", RewardRows("solution", conversational=True))
    assert conversational.score_batch(["Q0"] * 2, texts, ["12", "18"], extras) == [1.0, 1.0]
    (given, columns), = seen
    assert [m["role"] for m in given[0]] == ["assistant", "tool", "assistant"] and columns == []
    plain = adapt(tool_used, "rewards.py:tool_used", RewardRows("solution", conversational=False))
    assert plain.score_batch(["Q0"] * 2, texts, ["12", "18"], extras) == [0.0, 0.0]
    assert seen[1][0] == texts  # the whole trajectory as text, tool turns included (TRL's standard format)
    # a row scored before launch (no rollout yet) still gets TRL's one assistant message
    assert conversational("Q0", "The answer is 12.", "12", solution="12") == 0.0
    assert seen[2][0] == [[{"role": "assistant", "content": "The answer is 12."}]]
