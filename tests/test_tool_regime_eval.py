"""bench/tool_regime_eval.py, the harness that measures the tool regime's SFT policies with the calculator's answers
supplied (until the multi-turn rollout loop replaces it): its exact calculator, and a rollout that reproduces, token
for token, the segment encoding SFT trains on. A scripted stand-in for the model: single process, a few seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.tool_regime_eval import calculator_turn, exact_calculator, rollout
from grpo_mega.data.synthetic import Problem, Step
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.data.tool_task import build_tool_task, encode_segments, segments_text, tool_segments
from grpo_mega.reward.synthetic import synthetic_reward

PROBLEM = Problem(start=47, steps=(Step(47, "*", 86, 4042), Step(4042, "+", 55, 4097), Step(4097, "-", 98, 3999)))


def test_the_exact_calculator_and_its_errors():
    assert exact_calculator("347 * 86") == 29842
    assert exact_calculator("-(12 - 30) * 99999999999") == 1799999999982  # exact: no float rounding
    for bad in ("2 ** 10", "1 / 2", "__import__('os')", "1.5 + 1", "3 +"):
        with pytest.raises(ValueError):
            exact_calculator(bad)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert calculator_turn(" x " + call % "47 * 86") == ("4042", None)
    assert calculator_turn(call % "47 / 86")[1] == "exception"
    assert calculator_turn('<tool_call>{"name": "python", "arguments": {}}</tool_call>')[1] == "unknown_tool"
    assert calculator_turn('<tool_call>{"name": "calculator"</tool_call>')[1] == "invalid_call"
    assert calculator_turn('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>')[1] == \
        "bad_arguments"


class ScriptedPolicy:
    """Puts all probability on the next token of ``script`` (the policy's tokens only), whatever it was fed: the
    tool turns the harness appends are context the script does not contain."""

    def __init__(self, script: list[int], vocab: int):
        self.script, self.vocab, self.emitted, self.fed = script, vocab, 0, []

    def __call__(self, input_ids, past_key_values=None, use_cache=True):
        self.fed.append(input_ids[0].tolist())
        logits = torch.full((1, input_ids.shape[1], self.vocab), -1e9)
        logits[0, -1, self.script[min(self.emitted, len(self.script) - 1)]] = 0.0
        self.emitted += 1
        return SimpleNamespace(logits=logits, past_key_values="cache")


def test_a_rollout_with_answers_supplied_is_the_demonstration_sft_trains_on(tmp_path):
    files = build_tool_task(tmp_path, num_train=200, num_heldout=10, seed=0)
    tokenizer = load_tokenizer(files.tokenizer)
    segments = tool_segments(PROBLEM)
    demo_ids, demo_mask = encode_segments(tokenizer, segments, tokenizer.eos_token_id)
    policy = [token for token, keep in zip(demo_ids, demo_mask) if keep]
    model = ScriptedPolicy(policy, len(tokenizer))
    prompt = list(tokenizer.encode(PROBLEM.prompt))
    trajectory = rollout(model, tokenizer, prompt, seed=0, temperature=0.0)
    assert (trajectory.response_ids, trajectory.mask) == (demo_ids, demo_mask)
    assert (trajectory.calls, trajectory.errors, trajectory.finished) == (3, {}, True)
    # the prompt is prefilled once; each tool turn goes in with the token that closed the call, never re-encoded text
    assert model.fed[0] == prompt and sum(len(f) for f in model.fed) == len(prompt) + len(demo_ids) - 1
    text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
    assert text == segments_text(segments) and synthetic_reward(PROBLEM.prompt, text, "3999") == 1.0

    # without the answers the policy writes on past its calls with nothing appended
    blind = rollout(ScriptedPolicy(policy, len(tokenizer)), tokenizer, prompt, seed=0, temperature=0.0,
                    supply_answers=False)
    assert blind.response_ids == policy and blind.calls == 0 and set(blind.mask) == {1}
