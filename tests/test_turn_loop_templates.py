"""The floor of the turn loop: the token stream of every multi-turn rollout (prompt + the policy's turns + the tool
turns it appended) equals the chat template's encoding of the rollout's final conversation, for each shipped model
family's real template (tests/fixtures/chat_templates: Qwen2.5, Qwen3 Thinking-2507, whose generation prompt opens
``<think>`` so every turn's reasoning is the policy's and ends with ``</think>``, Llama 3.1, SmolLM2, which
has no ``tools=`` support and gets the documented fallback: the output as a ``user`` turn
``<tool_response>...</tool_response>``).

Each tokenizer is built offline: a byte-level BPE with Qwen2's pre-tokenization (as grpo_mega.data.tokenizer's),
trained on a few texts, with the family's special tokens (and Qwen's ``<tool_call>`` / ``<think>`` tags as the
plain added tokens they are in Qwen's tokenizers) and its real template. The "policy" is scripted
(tests/turn_loop_doubles.ScriptedEngine): two calculator calls, then an answer, each turn its text's canonical
encoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_mega.rollout.base import SamplingConfig
from grpo_mega.rollout.tool_turns import TemplateToolTurns, tool_turns_for
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
from turn_loop_doubles import Calculator, ScriptedEngine

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
FAMILIES = {
    "qwen2.5": dict(template="qwen2.5-instruct.jinja", special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    added=QWEN_TAGS, eos="<|im_end|>", think=False),
    "qwen3": dict(template="qwen3-thinking-2507.jinja", special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  added=QWEN_TAGS + ["<think>", "</think>"], eos="<|im_end|>", think=True),
    "llama3.1": dict(template="llama-3.1-instruct.jinja", eos="<|eot_id|>", bos="<|begin_of_text|>", added=[],
                     special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|eom_id|>", "<|python_tag|>"], think=False),
    "smollm2": dict(template="smollm2-instruct.jinja", special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    added=[], eos="<|im_end|>", think=False),
}
QUESTION = "What is 17 * 23 + 5? Use the calculator."
CALLS = ["17 * 23", "391 + 5"]
CORPUS = [QUESTION, "I will use the calculator.", "The answer is 396.", "What is 17 * 23 + 5?",
          '{"name": "calculator", "arguments": {"expression": "17 * 23"}}', "You are a helpful assistant.",
          "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Environment: ipython",
          "Given the following functions, please respond with a JSON for a function call"] * 10


def family_tokenizer(family: dict):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=family["special"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=family["eos"],
                                        bos_token=family.get("bos"), pad_token=family["eos"])
    tokenizer.add_tokens(family["added"])  # not special: they stay in the text (stop strings, rewards see them)
    tokenizer.chat_template = (TEMPLATES / family["template"]).read_text()
    return tokenizer


def script_for(family: dict):
    think = family["think"]

    def script(prompt, sample, turn, prefix):
        thought = f"Step {turn + 1}.\n</think>\n\n" if think else ""  # after the template's "<think>\n"
        if turn < len(CALLS):
            call = '{"name": "calculator", "arguments": {"expression": "%s"}}' % CALLS[turn]
            return f"{thought}I will use the calculator.\n<tool_call>\n{call}\n</tool_call>"
        return f"{thought}The answer is 396.{family['eos']}"
    return script


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_token_stream_is_the_templates_encoding_of_the_final_conversation(name):
    family = FAMILIES[name]
    tokenizer = family_tokenizer(family)
    tools = Calculator()
    messages = [{"role": "user", "content": QUESTION}]
    prompt_text = tokenizer.apply_chat_template(messages, tools=tools.schemas(), tokenize=False,
                                                add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    tool_turns = tool_turns_for("hermes", tokenizer)
    assert isinstance(tool_turns, TemplateToolTurns)
    assert tool_turns.role == ("user" if name == "smollm2" else "tool")  # SmolLM2's template knows no tool role
    loop = TurnLoopEngine(ScriptedEngine(tokenizer, script_for(family)), tools, tokenizer,
                          TurnLoopSettings(max_response_tokens=400, max_turns=4), tool_turns)
    (rollout,) = loop.generate([prompt_ids], SamplingConfig(n=1, max_new_tokens=400))
    assert [t.ended for t in rollout.turns] == ["tool_call", "tool_call", "answer"]

    conversation = list(messages)
    for turn in rollout.turns:
        text = tokenizer.decode(rollout.response_ids[turn.start:turn.end], skip_special_tokens=True)
        conversation.append({"role": "assistant", "content": text})
        if turn.tool_end is not None:
            content = tokenizer.decode(rollout.response_ids[turn.end:turn.tool_end])
            output = "391" if turn is rollout.turns[0] else "396"
            assert output in content
            conversation += tool_turns.messages([output])
    rendered = tokenizer.apply_chat_template(conversation, tools=tools.schemas(), tokenize=False,
                                             add_generation_prompt=False)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    stream = prompt_ids + rollout.response_ids
    assert expected[:len(stream)] == stream
    # the rollout ends at the policy's end-of-turn token; the template may write a newline after it, nothing else
    assert tokenizer.decode(expected[len(stream):]).strip() == ""
    assert stream[-1] == tokenizer.eos_token_id


def test_qwen25s_tool_turn_keeps_the_newline_after_the_end_of_turn_token():
    """verl's legacy path lost the newline after ``<|im_end|>`` in 18 of 27 Qwen tool runs; the template's delta
    has it, and the loop appends exactly that delta."""
    tokenizer = family_tokenizer(FAMILIES["qwen2.5"])
    assert TemplateToolTurns(tokenizer).text(["391"]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
