"""The synthetic task that needs its tool (issue 75, part 5): its two surface forms, the segment-by-segment
encoding of a tool demonstration and its loss mask, the outcome reward of a tool trajectory, and SFT's loss on
masked tool tokens. Tokenizer only, plus one tiny torch loss: single process, a few seconds."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_mega.config import ConfigError, SFTConfig, load_config, validate_sft
from grpo_mega.data.batch import sequences_to_batch
from grpo_mega.data.synthetic import Problem, Step, StepVerdict, check_steps, parse_solution
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.data.tool_format import (FALLBACK_RESPONSE_CLOSE, FALLBACK_RESPONSE_OPEN, TOOL_CALL_CLOSE,
                                        fallback_tool_turn_text, parse_hermes_call)
from grpo_mega.data.tool_task import (SEGMENTS_FIELD, Segment, build_tool_task, check_segments, encode_segments,
                                      segments_text, tool_segments)
from grpo_mega.engine import LossScale
from grpo_mega.reward.synthetic import synthetic_reward, synthetic_step_reward
from grpo_mega.sft import load_sft_data, load_sft_examples, sft_loss

# "Start with 47. Multiply by 86. Add 55."
PROBLEM = Problem(start=47, steps=(Step(47, "*", 86, 4042), Step(4042, "+", 55, 4097)))


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool_task")
    files = build_tool_task(folder, num_train=300, num_heldout=20, seed=0)
    return files, load_tokenizer(files.tokenizer)


def test_the_two_surface_forms_of_one_problem():
    assert PROBLEM.prompt == "Q: Start with 47. Multiply by 86. Add 55. A:"
    assert PROBLEM.solution == " Step 1: 47 * 86 = 4042. Step 2: 4042 + 55 = 4097. The answer is 4097."
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert tool_segments(PROBLEM) == [
        Segment(" " + call % "47 * 86"),
        Segment("<tool_response>4042</tool_response>", tool=True),
        Segment(" Step 1: 47 * 86 = 4042. " + call % "4042 + 55"),
        Segment("<tool_response>4097</tool_response>", tool=True),
        Segment(" Step 2: 4042 + 55 = 4097. The answer is 4097."),
    ]
    # every policy turn but the last ends with the call the rollout loop stops at, and the call parses back
    for segment in tool_segments(PROBLEM)[:-1:2]:
        assert segment.text.endswith(TOOL_CALL_CLOSE)
    assert parse_hermes_call(tool_segments(PROBLEM)[2].text) == ("calculator", {"expression": "4042 + 55"})
    assert fallback_tool_turn_text("12") == FALLBACK_RESPONSE_OPEN + "12" + FALLBACK_RESPONSE_CLOSE


def test_the_reward_reads_a_tool_trajectory_and_its_steps():
    text = segments_text(tool_segments(PROBLEM))
    answer = str(PROBLEM.answer)
    assert synthetic_reward(PROBLEM.prompt, text, answer) == 1.0
    assert synthetic_reward(PROBLEM.prompt, text.replace("is 4097", "is 4096"), answer) == 0.0
    # the answer is the policy's sentence, not a number the tool printed: a trajectory that stops after the tool
    # turn with the right value has no answer
    stopped = "".join(s.text for s in tool_segments(PROBLEM)[:4])
    assert "4097" in stopped and synthetic_reward(PROBLEM.prompt, stopped, answer) == 0.0
    # the steps are the equations the policy writes after each call (a step ends where the next call begins)
    assert [s.body for s in parse_solution(text).steps] == ["47 * 86 = 4042.", "4042 + 55 = 4097."]
    assert check_steps(PROBLEM, text) == [StepVerdict.CORRECT, StepVerdict.CORRECT]
    wrong = text.replace("Step 1: 47 * 86 = 4042.", "Step 1: 47 * 86 = 4043.")
    assert check_steps(PROBLEM, wrong) == [StepVerdict.WRONG_ARITHMETIC, StepVerdict.CORRECT]
    rewards = synthetic_step_reward(PROBLEM.prompt, text, answer, steps=PROBLEM.to_record()["steps"])
    assert rewards.step_rewards == [1.0, 1.0, 1.0] and text[:rewards.step_ends[0]].endswith("= 4042.")


def test_a_demonstration_is_encoded_segment_by_segment_with_tool_turns_masked(task):
    _, tokenizer = task
    segments = tool_segments(PROBLEM)
    ids, mask = encode_segments(tokenizer, segments, tokenizer.eos_token_id)
    pieces = [tokenizer.encode(s.text, add_special_tokens=False) for s in segments]
    assert ids == [token for piece in pieces for token in piece] + [tokenizer.eos_token_id]
    assert mask == [int(not s.tool) for s, piece in zip(segments, pieces) for _ in piece] + [1]
    # the tokenizer round-trips each turn and the whole trajectory
    assert tokenizer.decode(ids[:-1]) == segments_text(segments)
    for segment, piece in zip(segments, pieces):
        assert tokenizer.decode(piece) == segment.text
    # the boilerplate of a call is a handful of tokens (the tokenizer learnt the tool format)
    assert len(pieces[0]) <= 30, tokenizer.convert_ids_to_tokens(pieces[0])


def _sft_cfg(files, *overrides):
    return load_config(SFTConfig, None, [f"model.hf_config={files.tokenizer}", f"data.train_file={files.train}",
                                         "data.on_bad_row=error", "data.max_length=512", *overrides], validate_sft)


def test_sft_data_of_both_forms(task):
    files, tokenizer = task
    rows = [json.loads(line) for line in files.train.read_text().splitlines()]
    text_prompts, text_responses, text_masks = load_sft_data(_sft_cfg(files), tokenizer)
    assert text_masks is None and len(text_prompts) == len(rows)
    assert tokenizer.decode(text_responses[0]) == rows[0]["solution"] + tokenizer.eos_token
    prompts, responses, masks = load_sft_data(_sft_cfg(files, f"data.segments_field={SEGMENTS_FIELD}"), tokenizer)
    assert prompts == text_prompts  # the same prompts: one task, two surface forms
    segments = check_segments(rows[0][SEGMENTS_FIELD], where="row 1")
    assert (responses[0], masks[0]) == encode_segments(tokenizer, segments, tokenizer.eos_token_id)
    assert load_sft_examples(_sft_cfg(files, f"data.segments_field={SEGMENTS_FIELD}"), tokenizer) == (prompts,
                                                                                                      responses)


def test_bad_segment_rows_and_settings_name_the_key(task, tmp_path):
    files, tokenizer = task
    with pytest.raises(ConfigError, match="data.segments_field"):
        _sft_cfg(files, "data.segments_field=tool_segments", "data.chat_template=true")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Q: A:", "tool_segments": [{"text": "<tool_response>1</tool_response>",
                                                                      "tool": True}]}) + "\n")
    with pytest.raises(Exception, match=r"bad.jsonl:1.*first and last segments must be the policy's"):
        load_sft_data(_sft_cfg(files, "data.segments_field=tool_segments", f"data.train_file={bad}"), tokenizer)
    with pytest.raises(Exception, match=r"missing segments field 'steps_x'"):
        load_sft_data(_sft_cfg(files, "data.segments_field=steps_x"), tokenizer)


def test_plain_batches_are_unchanged_and_masked_tokens_carry_no_loss():
    prompts, responses = [[5, 6], [7]], [[8, 9, 10], [11, 12]]
    plain = sequences_to_batch(prompts, responses, pad_id=0)
    all_ones = sequences_to_batch(prompts, responses, pad_id=0, response_masks=[[1, 1, 1], [1, 1]])
    assert all(torch.equal(plain[key], all_ones[key]) for key in plain)
    masked = sequences_to_batch(prompts, responses, pad_id=0, response_masks=[[1, 0, 1], [0, 1]])
    assert masked["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]]
    assert torch.equal(masked["input_ids"], plain["input_ids"])  # masked tokens stay in the row as context
    with pytest.raises(ValueError, match="one 0/1 value per response token"):
        sequences_to_batch(prompts, responses, pad_id=0, response_masks=[[1], [1, 1]])

    # SFT's loss: changing a masked (tool) token's target leaves it unchanged; an unmasked one's changes it
    torch.manual_seed(0)
    logits = torch.randn(*masked["input_ids"].shape, 16)
    scale = LossScale(global_tokens=float(masked["loss_mask"].sum()), global_seqs=2.0)

    def loss_of(input_ids):  # the engine's logprobs: position t holds log p(token t | tokens before it)
        logprobs = torch.log_softmax(logits, -1).gather(-1, input_ids[..., None])[..., 0]
        return sft_loss({"logprobs": logprobs}, masked, scale)[0]

    loss = loss_of(masked["input_ids"])
    tool_token = masked["input_ids"].clone()
    tool_token[0, 3] = 13  # row 0's second response token: mask 0
    tool_token[1, 1] = 14  # row 1's first response token: mask 0
    assert torch.equal(loss_of(tool_token), loss)
    policy_token = masked["input_ids"].clone()
    policy_token[0, 4] = 15  # row 0's third response token: mask 1
    assert not torch.equal(loss_of(policy_token), loss)
