"""Monte-Carlo labels of turn steps (prm/turn_labeling.py, the turn loop's continue_rollouts): one label per
assistant turn, each prefix continued through the turn loop with the real calculator and scored by the synthetic
verifier, the estimates checked by hand; the continuation keeps the prefix's turns and budget; the flags' checks."""

from __future__ import annotations

import argparse
import re

import pytest

from grpo_mega.data.prompts import PromptRecord
from grpo_mega.data.tokenizer import train_tokenizer
from grpo_mega.reward import get_reward_function
from grpo_mega.rollout.base import Completion, SamplingConfig, decode_response
from grpo_mega.rollout.stopping import cut_response
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
from grpo_mega.tools import SandboxConfig, build_toolset
from prm.label_command import add_label_arguments
from prm.turn_labeling import monte_carlo_turn_labels, sample_turn_solutions, turn_prefix
from prm.turn_setup import multi_turn_settings, step_kind_of
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
GOOD = "Q: Start with 12. Multiply by 34. Add 5. A:"   # 12 * 34 = 408, + 5 = 413
BAD = "Q: Start with 21. Multiply by 3. Add 5. A:"     # the policy calls 21 * 30: 630, + 5 = 635 (truth: 68)
TEXTS = [GOOD, BAD, CALL % "12 * 34", CALL % "408 + 5", "<tool_response>413</tool_response> The answer is 413."] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=300)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


class PrefixPolicy:
    """A policy whose turn is a function of its whole prefix text and of its row's position r in the generate call
    (sampling.n rows per prompt): first a calculator call on the first operation (21 * 30 for BAD: wrong), after
    one tool answer v a call "v + 5", after two the answer: the last tool answer w when r is even, w + 1 when odd.
    Turns are cut at the stop strings and EOS like a real engine's (``cut_response``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def turn(self, text: str, r: int) -> str:
        values = re.findall(r"<tool_response>(-?\d+)</tool_response>", text)
        if not values:
            return " " + CALL % ("12 * 34" if "Start with 12" in text else "21 * 30")
        if len(values) == 1:
            return " " + CALL % f"{values[0]} + 5"
        return f" The answer is {int(values[-1]) + r % 2}.</s>"

    def generate(self, prompt_ids, sampling: SamplingConfig) -> list[Completion]:
        out = []
        for index, prompt in enumerate(prompt_ids):
            for sample in range(sampling.n):
                text = self.turn(decode_response(self.tokenizer, prompt), index * sampling.n + sample)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                cut = cut_response(ids, eos_token_ids={self.tokenizer.eos_token_id}, stop=sampling.stop,
                                   decode=lambda t: decode_response(self.tokenizer, t),
                                   max_new_tokens=sampling.max_new_tokens)
                kept = ids[:cut.length]
                out.append(Completion(index, list(prompt), kept, [-0.1] * len(kept),
                                      decode_response(self.tokenizer, kept), cut.finish_reason))
        return out


class CountingTools:
    """The real calculator tool set (it runs inline), counting the calls it runs."""

    def __init__(self):
        self.toolset, self.calls = build_toolset(["calculator"], SandboxConfig()), []

    def __getattr__(self, name):
        return getattr(self.__dict__["toolset"], name)

    def run(self, calls, kwargs=None):
        self.calls += [c.arguments["expression"] for c in calls]
        return self.toolset.run(calls, kwargs)


def loop_of(tokenizer, tools, max_turns=4):
    return TurnLoopEngine(PrefixPolicy(tokenizer), tools, tokenizer,
                          TurnLoopSettings(max_response_tokens=120, max_turns=max_turns))


def records(tokenizer):
    return [PromptRecord(prompt=p, prompt_ids=tokenizer.encode(p, add_special_tokens=False), answer=a, raw_prompt=p,
                         source=f"t.jsonl:{i + 1}") for i, (p, a) in enumerate([(GOOD, "413"), (BAD, "68")])]


def test_each_turn_is_labelled_by_continuations_through_the_turn_loop(tokenizer):
    tools = CountingTools()
    loop = loop_of(tokenizer, tools)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=120)
    sampled = sample_turn_solutions(loop, tokenizer, records(tokenizer), samples_per_prompt=1, sampling=sampling,
                                    seed=3)
    assert sampled.dropped_empty == 0 and len(sampled.items) == 2
    good, bad = sampled.items
    assert [t.ended for t in good.completion.turns] == ["tool_call", "tool_call", "answer"]
    assert good.item.steps[1].startswith("<tool_response>408</tool_response>")  # step 2 opens with tool turn 1
    assert tools.calls == ["12 * 34", "21 * 30", "408 + 5", "630 + 5"]
    examples = monte_carlo_turn_labels(loop, sampled.items, n=2, sampling=sampling,
                                       reward_fn=get_reward_function("synthetic"), seed=4)
    # By hand (the policy's docstring; plan order A1, B1, A2, B2 with 2 rows each, r = the row's place in the call):
    # after GOOD's turn 2 (rows 4, 5) one answer of two is 413: 0.5; after GOOD's turn 1 the rows (0..3 of the
    # second call) call "408 + 5" through the calculator, then 0 answers 413 and 1 answers 414: 0.5; the last turn
    # is the rollout's own outcome (row 0 of its call: 413, right). BAD's prefixes carry 630 on: nothing is right.
    assert [e.soft_labels for e in examples] == [[0.5, 0.5, 1.0], [0.0, 0.0, 0.0]]
    assert [e.labels for e in examples] == [[True, True, True], [False, False, False]]
    assert [e.extra["outcome"] for e in examples] == [1.0, 0.0]
    assert tools.calls[4:] == ["408 + 5", "408 + 5", "630 + 5", "630 + 5"]  # the continuations' own calls
    for turn_item, example in zip(sampled.items, examples):
        stored = TurnSteps.from_row(example.extra[TURN_STEPS_FIELD], len(example.steps))
        assert stored == TurnSteps.of(turn_item.completion) and stored.texts(tokenizer) == example.steps


def test_a_continuation_keeps_the_prefix_and_its_turn_count(tokenizer):
    tools = CountingTools()
    full = loop_of(tokenizer, tools).generate([records(tokenizer)[0].prompt_ids], SamplingConfig(n=1, seed=1))[0]
    prefix = turn_prefix(full, 1)
    assert prefix.response_ids == full.response_ids[:full.turns[0].tool_end] and len(prefix.turns) == 1
    # with max_turns 2 the prefix's turn counts: the continuation's call is its second turn, so it is not run
    out = loop_of(tokenizer, tools, max_turns=2).continue_rollouts([prefix], SamplingConfig(n=2, seed=2))
    assert len(out) == 2 and len(tools.calls) == 2  # the two calls of the full rollout, none more
    for c in out:
        assert c.response_ids[:len(prefix.response_ids)] == prefix.response_ids
        assert c.response_mask[:len(prefix.response_ids)] == prefix.response_mask
        assert [t.ended for t in c.turns] == ["tool_call", "max_turns"]
    with pytest.raises(ValueError, match="prefix 0 does not end with a tool turn"):
        loop_of(tokenizer, tools).continue_rollouts([full], SamplingConfig(n=1))
    with pytest.raises(ValueError, match="turn 3 of the rollout ended 'answer' with no tool turn after it"):
        turn_prefix(full, 3)


def label_args(*flags):
    parser = argparse.ArgumentParser()
    add_label_arguments(parser)
    return parser.parse_args(["--policy", "p", "--data", "d", "--out", "o", *flags])


def test_turn_settings_come_from_the_policy_config_under_the_flags():
    saved = {"rollout": {"multi_turn": {"enable": True, "tools": ["python"], "max_turns": 6, "format": "code",
                                        "sandbox": {"timeout_s": 3.0}}}}
    settings = multi_turn_settings(label_args("--steps", "turns", "--max-turns", "3"), saved)
    assert (settings.tools, settings.max_turns, settings.format, settings.sandbox.timeout_s) == (["python"], 3,
                                                                                                  "code", 3.0)
    settings = multi_turn_settings(label_args("--steps", "turns", "--tools", "calculator"), None)
    assert (settings.tools, settings.max_turns, settings.format) == (["calculator"], 4, "hermes")
    with pytest.raises(ValueError, match="--steps turns needs tools: pass --tools"):
        multi_turn_settings(label_args("--steps", "turns"), {"rollout": {"multi_turn": {"enable": False}}})
    # what a step is: the flag, else a GRPO checkpoint's process_reward.steps, else text
    assert step_kind_of(label_args(), {"process_reward": {"steps": "turns"}}) == "turns"
    assert step_kind_of(label_args("--steps", "text"), {"process_reward": {"steps": "turns"}}) == "text"
    assert step_kind_of(label_args(), None) == "text"
    with pytest.raises(ValueError, match="--max-turns must be >= 1, got 0"):
        multi_turn_settings(label_args("--steps", "turns", "--tools", "calculator", "--max-turns", "0"), None)
