"""Turns as steps (prm/turn_steps.py, prm/turn_rendering.py): the step ends of a multi-turn completion at each turn's
last model token, the step texts (earlier tool turns in, the answering tool turn out), the PRM's input read from the
policy's tokens (tags after each step; the likelihood layout's steps on their model tokens), the stored row giving
back the same tokens and positions as the completion, and a row whose step ends pass its tokens refused naming the
file and line."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_mega.data.prompts import BadRowError
from grpo_mega.data.tokenizer import train_tokenizer
from grpo_mega.rollout.base import Completion, SamplingConfig, TurnRecord, decode_response
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
from prm.data import read_examples, write_stepwise
from prm.examples import StepExample
from prm.rendering import RenderSettings
from prm.scoring import StepScorer
from prm.turn_rendering import render_example, render_turn_steps, tag_ids_of
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps, check_step_ends, step_bounds_of_turns, step_spans
from turn_loop_doubles import Calculator, ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
TEXTS = ["Q: what is 12 * 34? A: The answer is 408.", CALL % "12 * 34", "<tool_response>408</tool_response>"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=300)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


def test_step_ends_are_each_turns_last_model_token():
    turns = [TurnRecord(0, 5, "tool_call", tool_end=9), TurnRecord(9, 12, "tool_call", tool_end=15),
             TurnRecord(15, 20, "answer")]
    assert step_bounds_of_turns(turns, 20) == ([0, 9, 15], [4, 11, 19])
    assert step_spans([4, 11, 19]) == [(0, 5), (5, 12), (12, 20)]  # step 2 opens with tool turn 1 (tokens 5..8)
    # a rollout that ended on a tool turn: those tokens are in no step; a turn without a token is no step
    assert step_bounds_of_turns([TurnRecord(0, 5, "tool_call", tool_end=9), TurnRecord(9, 9, "length")], 9) == (
        [0], [4])
    # no turn with a model token (no turn records, or only empty turns): no step (tests/test_turn_steps_rule.py)
    assert step_bounds_of_turns(None, 7) == ([], []) and step_bounds_of_turns([TurnRecord(0, 0, "void")], 0) == ([], [])


def test_the_prm_reads_turn_steps_from_the_policys_tokens():
    steps = TurnSteps(prompt_ids=[1, 2], response_ids=[10, 11, 12, 13, 14, 15], step_starts=[0, 4],
                      step_ends=[1, 5])  # turn 1: 10 11; tool turn: 12 13; turn 2: 14 15
    tagged = render_turn_steps(steps, [99])
    assert tagged.input_ids == [1, 2, 10, 11, 99, 12, 13, 14, 15, 99] and tagged.tag_positions == [4, 9]
    plain = render_turn_steps(steps, [])  # the likelihood layout: read at the last model token, min over 14 15
    assert plain.input_ids == [1, 2, 10, 11, 12, 13, 14, 15] and plain.tag_positions == [3, 7]
    assert plain.step_starts == [2, 6]  # the tool turn (12 13) is context of step 2, not its tokens
    assert render_turn_steps(steps, [], num_steps=1).input_ids == [1, 2, 10, 11]
    with pytest.raises(ValueError, match="rollout 3: token id 99 is outside the PRM tokenizer's 50 ids"):
        render_turn_steps(steps, [99], vocab_size=50, where="rollout 3")
    with pytest.raises(ValueError, match="more than max_length=7"):
        render_turn_steps(steps, [], max_length=7)


@pytest.mark.parametrize("ends, length, message", [
    ([], 5, "no step ends"), ([2, 5], 5, "step end 1 is token 5, past the response's 5 tokens"),
    ([3, 3], 5, "step end 1 .token 3. is not after step end 0"), ([-1], 5, "before the response"),
    ([1.0], 5, "not a token index")])
def test_bad_step_ends_say_which_and_why(ends, length, message):
    with pytest.raises(ValueError, match=message):
        check_step_ends(ends, length)


def scripted_rollouts(tokenizer):
    """Two prompts x 2 samples of the turn loop with the in-test calculator: call, call, answer."""
    def script(prompt, sample, turn, prefix):
        a, b = prompt + 2, sample + 3
        return [f"Compute. {CALL % f'{a} * {b}'}", f" Then {CALL % f'{a * b} + 1'}",
                f" The answer is {a * b + 1}.</s>"][turn]

    loop = TurnLoopEngine(ScriptedEngine(tokenizer, script), Calculator(), tokenizer,
                          TurnLoopSettings(max_response_tokens=200, max_turns=4))
    prompts = [tokenizer.encode(f"Q{p}: compute. A:", add_special_tokens=False) for p in range(2)]
    return loop.generate(prompts, SamplingConfig(n=2, max_new_tokens=200, seed=1))


def test_completion_steps_and_the_stored_row_agree(tokenizer, tmp_path):
    completions = scripted_rollouts(tokenizer)
    examples = []
    for c in completions:
        steps = TurnSteps.of(c)
        assert steps.step_ends == [t.end - 1 for t in c.turns] and steps.step_starts == [t.start for t in c.turns]
        texts = steps.texts(tokenizer)
        # step 1 is the first turn; step 2 opens with the tool's answer to it; the steps rebuild the whole text
        assert texts[0].endswith("</tool_call>") and texts[1].startswith("<tool_response>")
        assert "".join(texts) == c.text == decode_response(tokenizer, c.response_ids)
        examples.append(StepExample(prompt=f"Q{c.prompt_index}: compute. A:", steps=texts, labels=[True] * 3,
                                    extra={TURN_STEPS_FIELD: steps.to_row()}))
    path = write_stepwise(tmp_path / "turns.jsonl", examples)
    read = read_examples(path, "auto", on_bad_row="error")
    for c, example in zip(completions, read):
        stored = TurnSteps.from_row(example.extra[TURN_STEPS_FIELD], len(example.steps))
        assert stored == TurnSteps.of(c)
        assert stored.texts(tokenizer) == example.steps
    # the PRM reads the same tokens and the same score positions from the completion and from the row
    for settings in (RenderSettings(step_tag=""), RenderSettings(step_tag=" ки")):
        live = [render_turn_steps(TurnSteps.of(c), tag_ids_of(tokenizer, settings)) for c in completions]
        stored = [render_example(tokenizer, e, settings) for e in read]
        assert [r.input_ids for r in live] == [r.input_ids for r in stored]
        assert [r.tag_positions for r in live] == [r.tag_positions for r in stored]
        assert [r.step_starts for r in live] == [r.step_starts for r in stored]
        if not settings.step_tag:  # token in: exactly the policy's prompt and response ids, read at the turns' ends
            assert [r.input_ids for r in live] == [c.prompt_ids + c.response_ids for c in completions]
            assert [r.tag_positions for r in live] == [[len(c.prompt_ids) + t.end - 1 for t in c.turns]
                                                       for c in completions]


def test_a_row_whose_step_ends_pass_its_tokens_is_one_line_naming_file_and_line(tmp_path):
    good = {"prompt": "Q", "completions": ["a", "b"], "labels": [True, False],
            TURN_STEPS_FIELD: {"prompt_ids": [4], "response_ids": [5, 6, 7], "step_starts": [0, 1],
                               "step_ends": [0, 2]}}
    bad = {**good, TURN_STEPS_FIELD: {**good[TURN_STEPS_FIELD], "step_ends": [0, 3]}}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(BadRowError) as raised:
        read_examples(path, "auto", on_bad_row="error")
    message = str(raised.value)
    assert "\n" not in message and f"{path}:2" in message
    assert "field 'turn_steps': step end 1 is token 3, past the response's 3 tokens" in message
    assert len(read_examples(path, "auto", on_bad_row="skip")) == 1  # skipped like any bad row
    uneven = {**good, TURN_STEPS_FIELD: {**good[TURN_STEPS_FIELD], "step_starts": [0], "step_ends": [2]}}
    path.write_text(json.dumps(uneven) + "\n")
    with pytest.raises(BadRowError, match="has 1 step ends for 2 steps"):
        read_examples(path, "auto", on_bad_row="error")


class IdEngine:
    """A forward-only engine double whose P(good) at a position is a function of the token there
    (``(id % 7 + 1) / 8``), so a score says which token it was read at."""

    def forward(self, batch):
        ids = batch["input_ids"].float()
        return {"good_logprob": torch.log((ids % 7 + 1) / 8)}


def test_the_trainers_call_and_prm_score_read_each_turn_at_the_same_token(tokenizer, tmp_path):
    completions = scripted_rollouts(tokenizer)
    examples = [StepExample(prompt="p", steps=TurnSteps.of(c).texts(tokenizer), labels=[True] * 3,
                            extra={TURN_STEPS_FIELD: TurnSteps.of(c).to_row()}) for c in completions]
    read = read_examples(write_stepwise(tmp_path / "t.jsonl", examples), "auto", on_bad_row="error")
    for tag in ("", " ки"):
        scorer = StepScorer(IdEngine(), tokenizer, RenderSettings(step_tag=tag))
        live = scorer.score_turn_steps([TurnSteps.of(c) for c in completions])
        assert live == scorer.score_examples(read)
        if not tag:  # read at each turn's last model token
            assert live == [[pytest.approx((c.response_ids[t.end - 1] % 7 + 1) / 8) for t in c.turns]
                            for c in completions]
