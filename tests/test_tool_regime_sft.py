"""bench/tool_regime_sft.py measures the tool regime's SFT policies through grpo-mega's own turn loop and calculator:
a policy that writes a tool demonstration's policy segments gets, from the loop, exactly the token ids and loss mask
SFT trained on (the ``<tool_response>`` turns encoded on their own, mask 0), and the bench's figures count what the
rollouts did. A scripted engine stands in for the model: single process, a few seconds."""

from __future__ import annotations

import sys
from pathlib import Path

from grpo_mega.data.synthetic import Problem, Step
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.data.tool_task import build_tool_task, encode_segments, segments_text, tool_segments
from grpo_mega.rollout.base import SamplingConfig
from turn_loop_doubles import ScriptedEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tool_regime_sft import measure, with_calculator  # noqa: E402  (bench/tool_regime_sft.py)

PROBLEM = Problem(start=47, steps=(Step(47, "*", 86, 4042), Step(4042, "+", 55, 4097), Step(4097, "-", 98, 3999)))


def test_the_turn_loop_with_the_calculator_gives_the_demonstration_sft_trains_on(tmp_path):
    files = build_tool_task(tmp_path, num_train=200, num_heldout=10, seed=0)
    tokenizer = load_tokenizer(files.tokenizer)
    segments = tool_segments(PROBLEM)
    demo_ids, demo_mask = encode_segments(tokenizer, segments, tokenizer.eos_token_id)
    policy_turns = [segment.text for segment in segments if not segment.tool]
    eos = tokenizer.eos_token_id

    def encode(text):  # the last turn ends the trajectory with EOS, as the demonstration does
        return list(tokenizer.encode(text, add_special_tokens=False)) + ([eos] if text == policy_turns[-1] else [])

    engine = ScriptedEngine(tokenizer, lambda prompt, sample, turn, prefix: policy_turns[turn], encode)
    loop = with_calculator(engine, tokenizer, max_tokens=220)
    (rollout,) = loop.generate([list(tokenizer.encode(PROBLEM.prompt))],
                               SamplingConfig(temperature=1.0, max_new_tokens=220, seed=0))
    assert (rollout.response_ids, rollout.response_mask) == (demo_ids, demo_mask)  # the real calculator's answers
    assert [turn.ended for turn in rollout.turns] == ["tool_call"] * 3 + ["answer"]
    assert rollout.text == segments_text(segments)

    figures = measure(with_calculator(ScriptedEngine(tokenizer, lambda *a: policy_turns[a[2]], encode), tokenizer,
                                      max_tokens=220), tokenizer, [PROBLEM], seed=0, max_tokens=220)
    assert figures["pass_at_1"] == 1.0 and figures["tool_calls_per_rollout"] == 3 and figures["tool_errors"] == {}
    assert figures["ended_with_eos"] == 1.0
    assert figures["tool_token_share"] == round(demo_mask.count(0) / len(demo_mask), 4)
    # without the loop the policy writes on past its calls, nothing appended: one turn, no call run
    blind = measure(ScriptedEngine(tokenizer, lambda *a: "".join(policy_turns), lambda text: encode(text) + [eos]),
                    tokenizer, [PROBLEM], seed=0, max_tokens=220)
    assert blind["tool_calls_per_rollout"] == 0 and blind["rollouts_with_a_tool_call"] == 1.0
    assert blind["tool_token_share"] == 0.0 and blind["ended_with_eos"] == 1.0

