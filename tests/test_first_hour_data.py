"""Issue 79 items 7 and 8, a verl / TRL user's files with a shipped config: a config's prompt-field keys do not hide
a layout the rows show (verl's parquet, TRL's standard ``prompt`` column, a ``messages`` conversation), one line says
which won, ``data.format=verl`` means verl's layout whatever ``data.prompt_field`` says, and what two files need is
said in one message, not in two refusals in a row."""

from __future__ import annotations

import re

import pytest
from test_data_formats import grpo_config, verl_gsm8k_rows, write_jsonl, write_parquet

from grpo_mega.config import ConfigError
from grpo_mega.config.preflight import check_prompt_files
from grpo_mega.data.formats import FieldSettings, choose_layout

SMALL_MODEL_DATA = ("data.prompt_field=question", "data.answer_field=answer")
"""configs/small-model_grpo.yaml's data keys (GSM8K's question / answer columns)."""


def test_a_verl_parquet_is_read_as_verl_with_the_small_model_configs_prompt_field(tmp_path, capsys):
    path = write_parquet(verl_gsm8k_rows(3), tmp_path / "gsm8k" / "train.parquet")
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={path}", *SMALL_MODEL_DATA))
    assert capsys.readouterr().err == (
        f"data.train_file={path}: the rows have no data.prompt_field='question': read as verl (detected): "
        "conversation in 'prompt', answer in 'reward_model.ground_truth'\n")
    # the verl preset: verl's layout, whatever the plain-prompt keys say
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={path}", *SMALL_MODEL_DATA, "data.format=verl"))
    assert capsys.readouterr().err == (
        f"data.train_file={path}: data.format=verl: verl's conversation in 'prompt' read (data.prompt_field="
        "'question' holds no conversation in these rows)\n")


def test_a_prompt_field_the_rows_have_still_wins():
    row = {"question": "What is 2 + 2?", "prompt": "ignored", "answer": "4"}
    layout = choose_layout(FieldSettings(prompt_field="question"), row)
    assert (layout.format, layout.prompt_field, layout.note) == ("plain", "question", "")
    verl = {"my_prompt": [{"role": "user", "content": "2 + 2?"}], "reward_model": {"ground_truth": "4"}}
    layout = choose_layout(FieldSettings(format="verl", prompt_field="my_prompt"), verl)
    assert (layout.prompt_field, layout.note) == ("my_prompt", "")


def test_trls_standard_prompt_column_is_read_when_the_configured_field_is_absent(tmp_path, capsys):
    """The issue's case: the small-model config, a chat train file and a plain {prompt, answer} eval file took two
    refusals in a row (messages_field / chat_template, then prompt_field); both are read now, each file saying how."""
    chat = write_jsonl([{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}] * 2,
                       tmp_path / "chat.jsonl")
    plain = write_jsonl([{"prompt": "What is 2 + 2?", "answer": "4"}] * 2, tmp_path / "plain.jsonl")
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={chat}", f"data.eval_file={plain}", *SMALL_MODEL_DATA,
                                   "data.on_bad_row=error"))
    assert capsys.readouterr().err.splitlines() == [
        f"data.train_file={chat}: the rows have no data.prompt_field='question': read as chat (detected): "
        "conversation in 'messages', answer in 'answer'",
        f"data.eval_file={plain}: the rows have no data.prompt_field='question': read as plain (detected): "
        "prompt text in 'prompt', answer in 'answer'"]
    layout = choose_layout(FieldSettings(format="trl", prompt_field="question"), {"prompt": "2 + 2?", "answer": "4"})
    assert (layout.format, layout.prompt_field, layout.conversation) == ("trl", "prompt", False)


def test_what_both_files_need_is_one_message(tmp_path):
    train = write_jsonl([{"text": "What is 2 + 3?", "answer": "5"}], tmp_path / "train.jsonl")
    heldout = write_jsonl([{"query": "What is 2 + 2?", "answer": "4"}], tmp_path / "heldout.jsonl")
    with pytest.raises(ConfigError) as error:
        check_prompt_files(grpo_config(tmp_path, f"data.train_file={train}", f"data.eval_file={heldout}"))
    message = str(error.value)
    assert "\n" not in message
    assert re.search(rf"^data.train_file={train}: .*missing prompt field 'prompt'.*'text'.*; and "
                     rf"data.eval_file={heldout}: .*missing prompt field 'prompt'.*'query'", message), message
