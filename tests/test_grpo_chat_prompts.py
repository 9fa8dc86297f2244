"""Issue 51: GRPO and eval read chat-format prompt rows (TRL's conversational prompts): ``{"messages": [system /
user turns], "answer": ...}`` with ``data.messages_field`` (SFT's name), rendered by the tokenizer's chat template
with its generation prompt; a row that the settings cannot read names the options that would read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_grpo_mega
from small_model import build_tokenizer, gsm8k_rows, tokenizer_texts
from tiny_task import SMALL_RUN, build_tiny_task

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.data.prompts import BadRowError, load_prompt_dataset
from grpo_mega.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
SYSTEM = "Solve it."
# A template the tiny task's byte-level tokenizer writes with its own pieces: turns joined by a space, and the
# generation prompt " A:" (the synthetic task's answer cue), so a rendered prompt reads as the task's own prompts.
TINY_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %} A:{% endif %}")


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol_tokenizer")
    build_tokenizer(tokenizer_texts(gsm8k_rows(64)), folder)
    return folder


def test_messages_rows_are_rendered_by_the_chat_template_with_the_generation_prompt(chat_tokenizer_dir, tmp_path):
    rows = gsm8k_rows(3, seed=5)
    data = _write(tmp_path / "chat.jsonl", [{"messages": _conversation(row["question"]), "answer": row["answer"],
                                             "source": "gsm8k"} for row in rows])
    tokenizer = load_tokenizer(chat_tokenizer_dir)
    records = load_prompt_dataset(data, tokenizer, prompt_length=512, messages_field="messages",
                                  use_chat_template=True, on_bad_row="error").records
    for record, row in zip(records, rows):
        expected = tokenizer.apply_chat_template(_conversation(row["question"]), tokenize=False,
                                                 add_generation_prompt=True)
        assert record.prompt == expected and expected.endswith("<|im_start|>assistant\n")
        assert SYSTEM in record.prompt  # the row's own system turn, not the template's default
        assert record.prompt_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
        assert record.raw_prompt == row["question"] and record.answer == str(row["answer"])
        assert record.extra == {"source": "gsm8k"}


def test_a_messages_row_read_as_a_prompt_row_names_the_options_that_read_it(chat_tokenizer_dir, tmp_path):
    data = _write(tmp_path / "chat.jsonl", [{"messages": _conversation("2 + 2?"), "answer": "4"}])
    tokenizer = load_tokenizer(chat_tokenizer_dir)
    with pytest.raises(BadRowError, match="set data.messages_field=messages data.chat_template=true"):
        load_prompt_dataset(data, tokenizer, prompt_length=512, on_bad_row="error", format="plain")
    # data.format=auto (the default) reads it as the conversation it is (tests/test_data_formats.py)
    assert load_prompt_dataset(data, tokenizer, prompt_length=512).records[0].raw_prompt == "2 + 2?"
    trl = _write(tmp_path / "trl.jsonl", [{"prompt": _conversation("2 + 2?"), "answer": "4"}])  # TRL's own key
    with pytest.raises(BadRowError, match="must be a non-empty string.*data.messages_field=prompt"):
        load_prompt_dataset(trl, tokenizer, prompt_length=512, on_bad_row="error", format="plain")
    records = load_prompt_dataset(trl, tokenizer, prompt_length=512, messages_field="prompt", use_chat_template=True)
    assert records.records[0].raw_prompt == "2 + 2?"
    plain = _write(tmp_path / "plain.jsonl", [{"question": "2 + 2?", "answer": "4"}])
    with pytest.raises(BadRowError, match="data.messages_field=null data.prompt_field=question"):
        load_prompt_dataset(plain, tokenizer, prompt_length=512, messages_field="messages", use_chat_template=True,
                            on_bad_row="error", format="chat")
    # data.format=auto reads each file in its own layout: a plain row lacks only its prompt field's name
    with pytest.raises(BadRowError, match=r"missing prompt field 'prompt'; set data.prompt_field .* \['answer', "
                                          r"'question'\]"):
        load_prompt_dataset(plain, tokenizer, prompt_length=512, messages_field="messages", use_chat_template=True,
                            on_bad_row="error")
    bad_turns = _write(tmp_path / "turns.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "4"}],
                                                    "answer": "4"}])
    with pytest.raises(BadRowError, match="ends with the user's turn"):
        load_prompt_dataset(bad_turns, tokenizer, prompt_length=512, messages_field="messages",
                            use_chat_template=True, on_bad_row="error")


def test_messages_field_is_not_read_with_the_chat_template_turned_off():
    with pytest.raises(ConfigError, match="data.messages_field='messages' .* set data.chat_template=true"):
        load_config(GRPOConfig, None, ["data.train_file=x.jsonl", "model.hf_config=m", "data.messages_field=messages",
                                       "data.chat_template=false"], validate)
    # unset (null), conversations are rendered with the chat template and prompt texts without it
    load_config(GRPOConfig, None, ["data.train_file=x.jsonl", "model.hf_config=m", "data.messages_field=messages"],
                validate)


@pytest.fixture(scope="module")
def chat_task(tmp_path_factory):
    """The tiny synthetic task with a chat template, its prompts as conversations (a system turn, the question)."""
    root = tmp_path_factory.mktemp("chat_task")
    model_dir, train_file = build_tiny_task(root / "task")
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = TINY_TEMPLATE
    chat_model = root / "model"
    tokenizer.save_pretrained(chat_model)
    (chat_model / "config.json").write_text((model_dir / "config.json").read_text())
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    conversations = [{**{k: v for k, v in row.items() if k != "prompt"},
                      "messages": _conversation(row["prompt"].removesuffix(" A:"))} for row in rows]
    return chat_model, _write(root / "train.jsonl", conversations), _write(root / "eval.jsonl", conversations[:4])


def test_grpo_trains_and_eval_evaluates_on_chat_prompts_from_the_command_line(chat_task, tmp_path):
    model_dir, train_file, eval_file = chat_task
    chat = ["data.messages_field=messages", "data.chat_template=true", f"model.hf_config={model_dir}",
            f"data.eval_file={eval_file}", "data.max_eval_prompts=4"]
    small = [item for item in SMALL_RUN if not item.startswith("parallel.tensor")]
    run_dir = tmp_path / "run"
    trained = run_grpo_mega("train", "--config", GRPO, *chat, f"data.train_file={train_file}", f"trainer.run_dir={run_dir}",
                         "trainer.total_steps=1", "trainer.dump_rollouts=true", *small)
    assert trained.returncode == 0, trained.stderr[-3000:]
    dumped = [json.loads(line) for line in next((run_dir / "rollouts").glob("*.jsonl")).read_text().splitlines()]
    assert dumped and all(row["prompt"].startswith(SYSTEM + " Q: Start with ") and row["prompt"].endswith(" A:")
                          for row in dumped), dumped[:1]
    report = tmp_path / "eval.json"
    evaluated = run_grpo_mega("eval", "--config", GRPO, "--policy", str(run_dir), "--out", str(report), *chat,
                           f"data.train_file={train_file}", "parallel.device=cpu", "algorithm.response_length=12")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(report.read_text())["prompts"] == 4
