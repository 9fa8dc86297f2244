"""The PRM rendering contract: text = prompt + step + tag + ..., and each step's score token is its tag's last
token, with the synthetic task's byte-level tokenizer and a standard HF fast tokenizer (BOS, special tag, chat
template)."""

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from grpo_mega.data.synthetic import Difficulty, make_splits, task_texts
from grpo_mega.data.tokenizer import train_tokenizer
from prm.examples import StepExample
from prm.rendering import RenderedExample, RenderSettings, render, tokenize_many, tokenize_rendered

PROMPT = "Q: Start with 7. Add 5. Multiply by 3. A:"
STEPS = [" Step 1: 7 + 5 = 12.", " Step 2: 12 * 3 = 36.", " The answer is 36."]
QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRIMMING_TEMPLATE = "{% for m in messages %}{{ '[' + m['role'] + ']' + (m['content'] | trim) + '[end]' }}{% endfor %}"


@pytest.fixture(scope="module")
def synthetic_tokenizer(tmp_path_factory):
    train, _ = make_splits(100, 0, seed=0, difficulty=Difficulty(min_steps=1, max_steps=3))
    return train_tokenizer(task_texts(train), tmp_path_factory.mktemp("tokenizer"))


def standard_tokenizer(chat_template: str | None = QWEN_TEMPLATE) -> PreTrainedTokenizerFast:
    """A word-level HF fast tokenizer that adds a BOS and knows ``<extra_0>`` as a special token (Qwen-PRM style)."""
    specials = ["<unk>", "<s>", "</s>", "<extra_0>", "<|im_start|>", "<|im_end|>"]
    words = "system user assistant Q Start with 7 Add 5 Multiply by 3 A : Step 1 2 = 12 * 36 The answer is . ки"
    words += " Be exact"
    vocab = {token: index for index, token in enumerate(specials + words.split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


def decoded_prefixes(tokenizer, rendered: RenderedExample) -> list[str]:
    return [tokenizer.decode(rendered.input_ids[: p + 1], skip_special_tokens=False) for p in rendered.tag_positions]


def test_render_plain_text_and_tag_offsets():
    text, ends = render("P:", ["a", "bc"], RenderSettings(step_tag=" ки"))
    assert text == "P:a киbc ки"
    assert ends == [6, 11]
    assert [text[:end] for end in ends] == ["P:a ки", "P:a киbc ки"]
    assert render("P:", [], RenderSettings(step_tag="<extra_0>")) == ("P:", [])


def test_synthetic_tokenizer_multibyte_tag_scores_at_its_last_byte_token(synthetic_tokenizer):
    settings = RenderSettings(step_tag=" ки")
    rendered = tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, settings)
    assert rendered.input_ids == synthetic_tokenizer(PROMPT + " ки".join(STEPS) + " ки")["input_ids"]
    # "и" is two byte-level tokens; the score token is the second of them, so each prefix decodes to the tag whole.
    prefixes = decoded_prefixes(synthetic_tokenizer, rendered)
    assert prefixes == [PROMPT + "".join(f"{s} ки" for s in STEPS[: k + 1]) for k in range(3)]
    assert rendered.tag_positions[-1] == len(rendered.input_ids) - 1


def test_synthetic_tokenizer_with_an_unknown_ascii_tag(synthetic_tokenizer):
    rendered = tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, RenderSettings(step_tag="<extra_0>"))
    pieces = synthetic_tokenizer.convert_ids_to_tokens(rendered.input_ids)
    assert [pieces[p] for p in rendered.tag_positions] == [">", ">", ">"]
    expected = PROMPT + STEPS[0] + "<extra_0>" + STEPS[1] + "<extra_0>"
    assert decoded_prefixes(synthetic_tokenizer, rendered)[1] == expected


def test_standard_tokenizer_keeps_bos_and_scores_at_the_special_tag():
    tokenizer = standard_tokenizer()
    tag_id = tokenizer.convert_tokens_to_ids("<extra_0>")
    rendered = tokenize_rendered(tokenizer, PROMPT, STEPS, RenderSettings(step_tag="<extra_0>"))
    assert rendered.input_ids[0] == tokenizer.bos_token_id
    assert [rendered.input_ids[p] for p in rendered.tag_positions] == [tag_id] * 3
    assert rendered.input_ids.count(tag_id) == 3
    # Hand-counted: BOS, "Q : Start with 7 . Add 5 . Multiply by 3 . A :" (15), then "Step 1 : 7 + 5 = 12 ." where
    # "+" is unknown (9) -> first tag at 1 + 15 + 9 = 25.
    assert rendered.tag_positions[0] == 25


def test_chat_template_wraps_prompt_and_tagged_steps_like_qwen_prm():
    tokenizer = standard_tokenizer()
    settings = RenderSettings(step_tag="<extra_0>", chat_template=True, system_prompt="Be exact")
    text, ends = render(PROMPT, STEPS, settings, tokenizer)
    body = "".join(step + "<extra_0>" for step in STEPS)
    assert text == (
        "<|im_start|>system\nBe exact<|im_end|>\n"
        f"<|im_start|>user\n{PROMPT}<|im_end|>\n"
        f"<|im_start|>assistant\n{body}<|im_end|>\n"
    )
    assert all(text[:end].endswith("<extra_0>") for end in ends) and text[ends[-1] :] == "<|im_end|>\n"
    rendered = tokenize_rendered(tokenizer, PROMPT, STEPS, settings)
    assert rendered.input_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # the template's, no BOS added
    assert tokenizer.bos_token_id not in rendered.input_ids
    tag_id = tokenizer.convert_tokens_to_ids("<extra_0>")
    assert [rendered.input_ids[p] for p in rendered.tag_positions] == [tag_id] * 3


def test_chat_template_that_trims_the_assistant_text():
    tokenizer = standard_tokenizer(TRIMMING_TEMPLATE)
    settings = RenderSettings(step_tag="<extra_0>", chat_template=True)
    text, ends = render(PROMPT, STEPS, settings, tokenizer)
    assert text.startswith(f"[user]{PROMPT}[end][assistant]Step 1: 7 + 5 = 12.<extra_0> Step 2")
    assert [text[end - 9 : end] for end in ends] == ["<extra_0>"] * 3
    assert text[: ends[0]].endswith("[assistant]Step 1: 7 + 5 = 12.<extra_0>")
    rendered = tokenize_rendered(tokenizer, PROMPT, STEPS, settings)
    assert [rendered.input_ids[p] for p in rendered.tag_positions] == [tokenizer.convert_tokens_to_ids("<extra_0>")] * 3


def test_chat_template_requested_without_one():
    settings = RenderSettings(step_tag="<extra_0>", chat_template=True)
    with pytest.raises(ValueError, match="has no chat template"):
        tokenize_rendered(standard_tokenizer(None), PROMPT, STEPS, settings)
    example = StepExample(prompt=PROMPT, steps=STEPS, source="b.jsonl:7")
    with pytest.raises(ValueError, match="b.jsonl:7: RenderSettings.chat_template is on but the tokenizer has no"):
        tokenize_many(standard_tokenizer(None), [example], settings)


def test_too_long_says_how_long(synthetic_tokenizer):
    settings = RenderSettings(step_tag=" ки")
    length = len(tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, settings).input_ids)
    assert len(tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, settings, max_length=length).input_ids) == length
    with pytest.raises(ValueError, match=f"has {length} tokens, more than max_length={length - 1}"):
        tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, settings, max_length=length - 1)


def test_tag_position_not_found_when_no_token_covers_the_tag():
    # The word-level tokenizer drops whitespace, so a newline tag has no token at all.
    with pytest.raises(ValueError, match=r"no token covers the last character of step 0's tag '\\n'"):
        tokenize_rendered(standard_tokenizer(), PROMPT, STEPS, RenderSettings(step_tag="\n"))


def test_two_tags_on_one_token_and_a_tag_running_into_the_next_step():
    tokenizer = standard_tokenizer()
    # "." after an empty step: "..." is one unknown word, holding the last character of both tags.
    with pytest.raises(ValueError, match=r"tags of steps 0 and 1 \('\.'\) end on the same token"):
        tokenize_rendered(tokenizer, "Q", [" Step 1", ""], RenderSettings(step_tag="."))
    # Tag "1" then a step starting with "2": "12" is one word, so the tag's token also holds the next step's text.
    with pytest.raises(ValueError, match="step 0's tag '1' runs on past the tag"):
        tokenize_rendered(tokenizer, "Q", [" Step ", "2 = 3"], RenderSettings(step_tag="1"))


def test_tokenize_many_matches_one_at_a_time_and_names_the_source(synthetic_tokenizer):
    settings = RenderSettings(step_tag=" ки")
    examples = [
        StepExample(prompt=PROMPT, steps=STEPS, source="a.jsonl:1"),
        StepExample(prompt="Q: Start with 2. A:", steps=[" The answer is 2."], source="a.jsonl:2"),
        StepExample(prompt="Q:", steps=[], source="a.jsonl:3"),
    ]
    many = tokenize_many(synthetic_tokenizer, examples, settings)
    assert many == [tokenize_rendered(synthetic_tokenizer, e.prompt, e.steps, settings) for e in examples]
    assert many[2].tag_positions == []
    assert tokenize_many(synthetic_tokenizer, [], settings) == []
    with pytest.raises(ValueError, match="a.jsonl:1: rendered example has"):
        tokenize_many(synthetic_tokenizer, examples, settings, max_length=10)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="step_tag must be a string"):
        RenderSettings(step_tag=None)
    with pytest.raises(ValueError, match="system_prompt needs chat_template"):
        RenderSettings(step_tag=" ки", system_prompt="hi")


def test_without_a_tag_each_step_is_read_at_its_own_last_token(synthetic_tokenizer):
    """The likelihood layout: the text is the prompt and the steps as written, a step's tokens run from its
    step_starts entry to its tag position (its last token)."""
    settings = RenderSettings(step_tag="")
    rendered = tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, settings)
    assert rendered.input_ids == synthetic_tokenizer(PROMPT + "".join(STEPS))["input_ids"]
    decode = synthetic_tokenizer.decode
    steps = [decode(rendered.input_ids[first : last + 1])
             for first, last in zip(rendered.step_starts, rendered.tag_positions)]
    assert steps == STEPS
    assert decode(rendered.input_ids[: rendered.step_starts[0]]) == PROMPT
    assert rendered.step_starts[1:] == [last + 1 for last in rendered.tag_positions[:-1]]
    with pytest.raises(ValueError, match="an empty step cannot be scored without a step tag"):
        tokenize_rendered(synthetic_tokenizer, PROMPT, [STEPS[0], "", STEPS[1]], settings)


def test_without_a_tag_a_token_across_two_steps_is_an_error():
    # the word-level tokenizer splits on whitespace: "12" + "." of two steps ... "= 1" / "2." makes "12." one word
    tokenizer = standard_tokenizer()
    with pytest.raises(ValueError, match="last token of step 0 runs on into the next step's text"):
        tokenize_rendered(tokenizer, "Q", [" Step 1", "2 ."], RenderSettings(step_tag=""))


def test_tagged_renders_also_carry_step_starts(synthetic_tokenizer):
    rendered = tokenize_rendered(synthetic_tokenizer, PROMPT, STEPS, RenderSettings(step_tag=" ки"))
    decode = synthetic_tokenizer.decode
    spans = [decode(rendered.input_ids[first : last + 1])
             for first, last in zip(rendered.step_starts, rendered.tag_positions)]
    assert spans == [step + " ки" for step in STEPS]
