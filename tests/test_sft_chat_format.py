"""Chat-format SFT (issue 30, item 1): conversations and prompt/response rows rendered with the tokenizer's chat
template exactly as GRPO renders its prompts, the loss on the assistant turn only; and bad rows that name the key
to set (item 2). Tokenizer only: the small chat model's BPE and SmolLM2's ChatML template with a system prompt."""

from __future__ import annotations

import json

import pytest
from small_model import SYSTEM_PROMPT, build_tokenizer, gsm8k_rows, tokenizer_texts

from grpo_mega.config import ConfigError, SFTConfig, load_config, validate_sft
from grpo_mega.data.chat import ChatFormat
from grpo_mega.data.prompts import BadRowError, load_prompt_dataset
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.sft import load_sft_examples

ROWS = gsm8k_rows(6, seed=3)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol_tokenizer")
    build_tokenizer(tokenizer_texts(gsm8k_rows(64)), folder)
    return folder


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sft_cfg(tokenizer_dir, train_file, *overrides):
    return load_config(SFTConfig, None, [f"model.hf_config={tokenizer_dir}", f"data.train_file={train_file}",
                                         "data.on_bad_row=error", *overrides], validate_sft)


def test_prompt_response_rows_are_the_grpo_prompt_plus_the_assistant_turn(tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    train = _write(tmp_path / "gsm8k.jsonl", ROWS)
    cfg = _sft_cfg(tokenizer_dir, train, "data.chat_template=true", "data.prompt_field=question",
                   "data.response_field=answer")
    prompts, responses = load_sft_examples(cfg, tokenizer)
    grpo = load_prompt_dataset(train, tokenizer, prompt_length=512, prompt_field="question", answer_field="answer",
                               use_chat_template=True)
    assert len(prompts) == len(ROWS)
    for prompt, response, record, row in zip(prompts, responses, grpo.records, ROWS):
        assert prompt == record.prompt_ids  # SFT's context is exactly what GRPO gives the policy
        assert SYSTEM_PROMPT in record.prompt and record.prompt.endswith("<|im_start|>assistant\n")
        # the loss covers the assistant's text and its end-of-turn token, the token a rollout stops at
        assert response[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in response[:-1]
        assert tokenizer.decode(response) == row["answer"] + "<|im_end|>"
        full = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]},
                                              {"role": "assistant", "content": row["answer"]}], tokenize=False)
        assert tokenizer.decode(prompt + response) == full.removesuffix("\n")


def test_messages_rows_learn_the_last_assistant_turn(tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    conversation = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": ROWS[0]["question"]}, {"role": "assistant", "content": "Let me see."},
                    {"role": "user", "content": "Show the steps."}, {"role": "assistant", "content": ROWS[0]["answer"]}]
    train = _write(tmp_path / "chat.jsonl", [{"messages": conversation}])
    cfg = _sft_cfg(tokenizer_dir, train, "data.chat_template=true", "data.messages_field=messages")
    (prompt,), (response,) = load_sft_examples(cfg, tokenizer)
    context = tokenizer.decode(prompt)
    # the conversation's own system turn replaces the default; earlier turns are context, not loss
    assert context.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>") and SYSTEM_PROMPT not in context
    assert "Let me see.<|im_end|>" in context and context.endswith("Show the steps.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(response) == ROWS[0]["answer"] + "<|im_end|>"
    # same tokens as GRPO's rendering of the same turns
    assert prompt == ChatFormat(tokenizer).render_prompt(conversation[:-1])[1]


def test_plain_rows_keep_their_format(tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    train = _write(tmp_path / "plain.jsonl", [{"prompt": "Q: 2 + 3 = ?", "solution": " 5"}])
    (prompt,), (response,) = load_sft_examples(_sft_cfg(tokenizer_dir, train), tokenizer)
    assert tokenizer.decode(prompt) == "Q: 2 + 3 = ?" and response == tokenizer(" 5").input_ids + [tokenizer.eos_token_id]


def test_bad_rows_name_the_key_to_set(tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    train = _write(tmp_path / "gsm8k.jsonl", ROWS)
    cases = [
        ((), "missing prompt field 'prompt'; set data.prompt_field"),
        (("data.prompt_field=question",), "missing response field 'solution'; set data.response_field"),
        (("data.prompt_field=question", "data.response_field=answer", "data.chat_template=true",
          "data.messages_field=messages"), "missing messages field 'messages'; set data.messages_field"),
    ]
    for overrides, message in cases:
        with pytest.raises(BadRowError, match=message) as raised:
            load_sft_examples(_sft_cfg(tokenizer_dir, train, *overrides), tokenizer)
        assert f"{train}:1" in str(raised.value)  # and the file:line
    bad_turns = _write(tmp_path / "turns.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(BadRowError, match="last message must be the assistant's turn"):
        load_sft_examples(_sft_cfg(tokenizer_dir, bad_turns, "data.chat_template=true", "data.messages_field=messages"),
                          tokenizer)
    with pytest.raises(ConfigError, match="data.messages_field='messages' .* set data.chat_template=true"):
        _sft_cfg(tokenizer_dir, train, "data.messages_field=messages")


def _train_on_conversations(model_dir, train, run_dir):
    from grpo_mega.run.metrics import read_metrics
    from grpo_mega.sft import run_sft

    cfg = _sft_cfg(model_dir, train, "data.chat_template=true", "data.messages_field=messages",
                   f"trainer.run_dir={run_dir}", "trainer.total_steps=4", "trainer.batch_size=4",
                   "trainer.save_every=0", "trainer.progress_bar=false", "optim.lr=3e-3", "optim.min_lr=3e-3",
                   "optim.warmup_steps=0", "parallel.device=cpu")
    run_sft(cfg)
    return [row["sft/nll"] for row in read_metrics(run_dir / "metrics.jsonl")]


def test_sft_trains_the_small_chat_model_on_conversations(tmp_path):
    """A real run on messages rows, on the small chat model's shape (one layer for time): the assistant turns'
    NLL falls as the model learns them (the loader's rendering and mask are checked above)."""
    from dist_utils import run_distributed
    from small_model import build_small_chat_model

    model_dir = build_small_chat_model(tmp_path / "model", layers=1, data_rows=4)
    rows = gsm8k_rows(4, seed=0)
    conversations = [{"messages": [{"role": "user", "content": row["question"]},
                                   {"role": "assistant", "content": row["answer"]}]} for row in rows]
    train = _write(tmp_path / "chat.jsonl", conversations)
    [losses] = run_distributed(_train_on_conversations, 1, model_dir, train, tmp_path / "run", timeout=300)
    assert len(losses) == 4
    assert losses[-1] < 0.6 * losses[0], losses  # 10.9 -> 4.8 on the first try
