"""Issue 60 (data): the datasets users bring from verl and TRL, read with no override beyond naming the file.

verl's RL parquet (its examples/data_preprocess scripts: GSM8K, DAPO-Math) nests the answer in
``reward_model.ground_truth`` and holds the prompt as a conversation in ``prompt``; TRL's prompt-only datasets hold
a text (standard) or a conversation (conversational) in ``prompt``; clusters without hub access hold folders of
shards and ``datasets.save_to_disk`` folders. Each is built here (no hub) and read into records; each data file is
read in its own format; a missing or wrongly nested field is one line naming the file, the row and the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow
import pyarrow.parquet as parquet
import pytest
from small_model import build_tokenizer, gsm8k_rows, tokenizer_texts

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.config.preflight import check_paths, check_prompt_files
from grpo_mega.data.formats import FieldSettings, choose_layout
from grpo_mega.data.prompts import BadRowError, load_prompt_dataset
from grpo_mega.data.sources import DataSourceError, read_rows, resolve_source
from grpo_mega.data.tokenizer import load_tokenizer

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")


def verl_gsm8k_rows(count: int, split: str = "train") -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for index, row in enumerate(gsm8k_rows(count, seed=3)):
        solution = row["answer"].split("#### ")[-1]
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution},
                     "extra_info": {"split": split, "index": index, "answer": row["answer"],
                                    "question": row["question"]}})
    return rows


def dapo_rows(count: int) -> list[dict]:
    """Rows of DAPO-Math-17k's parquet (BytedTsinghua-SIA/DAPO-Math-17k, verl's layout)."""
    return [{"data_source": "math_dapo",
             "prompt": [{"content": DAPO_PREFIX + f"Find the sum of {a} and {a + 3}.\n\nRemember to put your answer "
                         "on its own line after \"Answer:\".", "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * a + 3), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"9a9b6eb4-a1cb-49d1-8c1e-62eaf2f7{a:04d}"}} for a in range(count)]


def write_parquet(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE with a ChatML template (SmolLM2's, with its default system turn)."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    build_tokenizer(tokenizer_texts(gsm8k_rows(64)), folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory, chat_tokenizer):
    """The same tokenizer without a chat template (a base model's)."""
    folder = tmp_path_factory.mktemp("plain_tokenizer")
    chat_tokenizer.save_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    tokenizer.chat_template = None
    return tokenizer


def load(path, tokenizer, **options):
    return load_prompt_dataset(path, tokenizer, prompt_length=400, on_bad_row="error",
                               use_chat_template=options.pop("use_chat_template", None), **options).records


def test_verl_gsm8k_parquet_is_read_with_no_override(tmp_path, chat_tokenizer, plain_tokenizer):
    rows = verl_gsm8k_rows(5)
    path = write_parquet(rows, tmp_path / "gsm8k" / "train.parquet")
    assert choose_layout(FieldSettings(), rows[0]).describe() == (
        "verl (detected): conversation in 'prompt', answer in 'reward_model.ground_truth'")
    records = load(path, chat_tokenizer)
    for number, (record, row) in enumerate(zip(records, rows), start=1):
        assert record.answer == row["reward_model"]["ground_truth"] and record.answer.isdigit()
        assert record.raw_prompt == row["prompt"][0]["content"]
        assert record.prompt == chat_tokenizer.apply_chat_template(row["prompt"], tokenize=False,
                                                                   add_generation_prompt=True)
        assert record.source == f"{path}:row {number}"
        # every other top-level column as verl's compute_score(data_source, solution_str, ground_truth, extra_info)
        # and TRL's reward(completions, **columns) need them
        assert record.extra == {key: row[key] for key in ("data_source", "ability", "reward_model", "extra_info")}
    # a base model's tokenizer (no chat template): the one user turn is the prompt
    assert [r.prompt for r in load(path, plain_tokenizer)] == [row["prompt"][0]["content"] for row in rows]


def test_dapo_math_parquet_is_read_with_no_override(tmp_path, chat_tokenizer):
    rows = dapo_rows(4)
    records = load(write_parquet(rows, tmp_path / "dapo.parquet"), chat_tokenizer)
    assert [r.answer for r in records] == ["3", "5", "7", "9"]
    assert all(r.extra["data_source"] == "math_dapo" and r.extra["extra_info"]["index"].startswith("9a9b")
               for r in records)
    assert records[0].raw_prompt.startswith("Solve the following math problem")


def test_trl_conversational_and_standard_prompts(tmp_path, chat_tokenizer):
    system = {"role": "system", "content": "Reason, then answer."}
    conversational = write_jsonl([{"prompt": [system, {"role": "user", "content": "What is 2 + 3?"}],
                                   "solution": "5", "level": 1}], tmp_path / "trl_conversational.jsonl")
    [record] = load(conversational, chat_tokenizer)
    assert record.prompt.startswith("<|im_start|>system\nReason, then answer.<|im_end|>")
    assert record.prompt.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert (record.raw_prompt, record.answer, record.extra) == ("What is 2 + 3?", "5", {"level": 1})
    standard = write_jsonl([{"prompt": "What is 2 + 3?", "answer": "5"}], tmp_path / "trl_standard.jsonl")
    [record] = load(standard, chat_tokenizer)
    assert (record.prompt, record.answer) == ("What is 2 + 3?", "5")  # a text is not wrapped unless asked
    [record] = load(standard, chat_tokenizer, use_chat_template=True)
    assert record.prompt.endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_an_explicit_format_reads_what_auto_would_guess_otherwise(tmp_path, chat_tokenizer):
    path = write_parquet(verl_gsm8k_rows(2), tmp_path / "verl.parquet")
    assert [r.answer for r in load(path, chat_tokenizer, format="verl")] == [r.answer for r in load(path, chat_tokenizer)]
    with pytest.raises(BadRowError, match=r"verl.parquet:row 1: prompt field 'prompt' must be a non-empty string"):
        load(path, chat_tokenizer, format="plain")
    # the answer can be named by its dotted path too: the full worked solution here
    [first, _] = load(path, chat_tokenizer, format="trl", answer_field="extra_info.answer")
    assert first.answer.endswith("#### " + first.extra["reward_model"]["ground_truth"])


def test_dotted_fields_reach_into_nested_objects(tmp_path, chat_tokenizer):
    rows = [{"question": {"text": "What is 2 + 3?", "lang": "en"}, "meta": {"gold": {"value": 5}}}]
    path = write_jsonl(rows, tmp_path / "nested.jsonl")
    [record] = load(path, chat_tokenizer, prompt_field="question.text", answer_field="meta.gold.value")
    assert (record.raw_prompt, record.answer, record.extra) == ("What is 2 + 3?", "5", rows[0])
    # a literal dotted key wins over the path
    [record] = load(write_jsonl([{"a.b": "Hi?", "answer": 1}], tmp_path / "dot.jsonl"), chat_tokenizer,
                    prompt_field="a.b")
    assert record.raw_prompt == "Hi?"


@pytest.mark.parametrize("answer_field, message", [
    ("reward_model.truth", r"verl.parquet:row 1: missing answer field 'reward_model.truth' \(no field "
                           r"'reward_model.truth': 'reward_model' has the fields \['ground_truth', 'style'\]\); "
                           r"set data.answer_field to the field that holds the answer"),
    ("extra_info.answer.value", r"verl.parquet:row 1: missing answer field 'extra_info.answer.value' "
                                r"\('extra_info.answer' is a str, not an object, so it has no field 'value'\)"),
    ("reward_model", r"verl.parquet:row 1: answer field 'reward_model' must be a string or number, got \{"),
    ("gold", r"verl.parquet:row 1: missing answer field 'gold'; set data.answer_field to the field that holds the "
             r"answer \(this row has \['ability', 'data_source', 'extra_info', 'prompt', 'reward_model'\]\)"),
])
def test_a_missing_or_wrongly_nested_field_is_one_line_naming_file_row_and_field(tmp_path, chat_tokenizer,
                                                                                  answer_field, message):
    path = write_parquet(verl_gsm8k_rows(2), tmp_path / "verl.parquet")
    with pytest.raises(BadRowError, match=message) as raised:
        load(path, chat_tokenizer, answer_field=answer_field)
    assert "\n" not in str(raised.value)


def test_sharded_folders_are_read_in_name_order(tmp_path, chat_tokenizer):
    rows = verl_gsm8k_rows(7)
    folder = tmp_path / "parquet"
    for index, (start, stop) in enumerate([(0, 3), (3, 5), (5, 7)]):  # written out of order on purpose
        write_parquet(rows[start:stop], folder / f"train-{2 - index:05d}-of-00003.parquet")
    records = load(folder, chat_tokenizer)
    order = rows[5:7] + rows[3:5] + rows[0:3]  # shard 00000 holds the last rows
    assert [r.extra["extra_info"]["index"] for r in records] == [row["extra_info"]["index"] for row in order]
    assert records[0].source == f"{folder / 'train-00000-of-00003.parquet'}:row 1"
    assert records[2].source == f"{folder / 'train-00001-of-00003.parquet'}:row 1"
    jsonl = tmp_path / "jsonl"
    for index in range(2):
        write_jsonl([{"prompt": f"Q{index}.{n}", "answer": n} for n in range(2)], jsonl / f"part-{index}.jsonl")
    assert [(r.raw_prompt, r.source) for r in load(jsonl, chat_tokenizer)] == [
        ("Q0.0", f"{jsonl / 'part-0.jsonl'}:1"), ("Q0.1", f"{jsonl / 'part-0.jsonl'}:2"),
        ("Q1.0", f"{jsonl / 'part-1.jsonl'}:1"), ("Q1.1", f"{jsonl / 'part-1.jsonl'}:2")]
    # a glob picks shards (here of one split of a folder that holds two)
    write_parquet(rows[:1], folder / "test-00000-of-00001.parquet")
    assert len(load(str(folder / "train-*.parquet"), chat_tokenizer)) == 7


def test_folders_that_name_no_single_dataset_are_refused_naming_the_fix(tmp_path):
    splits = tmp_path / "splits"
    write_jsonl([{"prompt": "a", "answer": 1}], splits / "train-00000-of-00001.jsonl")
    write_jsonl([{"prompt": "b", "answer": 2}], splits / "test-00000-of-00001.jsonl")
    with pytest.raises(DataSourceError, match=rf"several splits \(test, train\); name one, e.g. {splits}/train-\*.jsonl"):
        resolve_source(splits)
    gap = tmp_path / "gap"
    for index in (0, 2):
        write_jsonl([{"prompt": "a", "answer": 1}], gap / f"train-{index:05d}-of-00003.jsonl")
    with pytest.raises(DataSourceError, match="2 of the 3 shards of 'train' are here; missing train-00001-of-00003"):
        resolve_source(gap)
    mixed = tmp_path / "mixed"
    write_jsonl([{"prompt": "a", "answer": 1}], mixed / "a.jsonl")
    write_parquet([{"prompt": "a", "answer": 1}], mixed / "b.parquet")
    with pytest.raises(DataSourceError, match=r"holds both .jsonl and .parquet files"):
        resolve_source(mixed)
    nested = tmp_path / "snapshot"
    write_parquet([{"prompt": "a", "answer": 1}], nested / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(DataSourceError, match=rf"no .jsonl or .parquet files in this folder \(it holds \['data/'\]\); "
                                              rf"the shards may be in {nested}/data"):
        resolve_source(nested)
    with pytest.raises(DataSourceError, match="no file matches"):
        resolve_source(str(tmp_path / "none-*.parquet"))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        read_rows(tmp_path / "absent")


def test_save_to_disk_folders_are_read_with_pyarrow(tmp_path, chat_tokenizer):
    import datasets

    rows = verl_gsm8k_rows(6)
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=2)
    assert sorted(p.name for p in folder.iterdir()) == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow",
                                                        "dataset_info.json", "state.json"]
    assert resolve_source(folder).describe() == "a save_to_disk folder of 2 arrow files"
    records = load(folder, chat_tokenizer)
    assert [r.answer for r in records] == [row["reward_model"]["ground_truth"] for row in rows]
    assert records[3].source == f"{folder / 'data-00001-of-00002.arrow'}:row 1"
    assert records[0].extra["extra_info"] == rows[0]["extra_info"]
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(both))
    with pytest.raises(DataSourceError, match=rf"{both}: a DatasetDict saved with save_to_disk \(splits \['train', 'test'\]\); "
                                              rf"name one split's folder, e.g. {both}/train"):
        resolve_source(both)
    assert len(load(both / "test", chat_tokenizer)) == 2


def grpo_config(tmp_path: Path, *overrides: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    return load_config(GRPOConfig, None, [f"model.hf_config={model}", f"trainer.run_dir={tmp_path / 'run'}",
                                          *overrides], validate)


def test_each_file_is_read_in_its_own_format(tmp_path, chat_tokenizer):
    chat = write_jsonl([{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}] * 3,
                       tmp_path / "chat.jsonl")
    plain = write_jsonl([{"prompt": "What is 2 + 2?", "answer": "4"}] * 2, tmp_path / "plain.jsonl")
    for train, heldout in ((chat, plain), (plain, chat)):
        cfg = grpo_config(tmp_path, f"data.train_file={train}", f"data.eval_file={heldout}",
                          "data.messages_field=messages", "data.on_bad_row=error")
        check_paths(cfg)
        check_prompt_files(cfg)  # no error: each file in its own format
        for path in (train, heldout):
            [record, *_] = load(path, chat_tokenizer, messages_field="messages")
            assert record.answer in ("4", "5") and record.raw_prompt.startswith("What is")
    # set explicitly, a format reads every file that way: a plain eval file then fails before launch
    cfg = grpo_config(tmp_path, f"data.train_file={chat}", f"data.eval_file={plain}", "data.format=chat",
                      "data.messages_field=messages")
    with pytest.raises(ConfigError, match=rf"data.eval_file={plain}: none of its 2 rows is usable; the first: "
                                          rf"{plain}:1: missing messages field 'messages'; set data.messages_field"):
        check_prompt_files(cfg)
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={chat}", f"data.eval_file={plain}", "data.format=chat",
                                   "data.eval_format=plain", "data.messages_field=messages"))
    # auto: an eval file of another layout is told what it lacks in its own terms (one override reads it)
    questions = write_jsonl([{"question": "What is 2 + 2?", "answer": "4"}], tmp_path / "questions.jsonl")
    cfg = grpo_config(tmp_path, f"data.train_file={chat}", f"data.eval_file={questions}",
                      "data.messages_field=messages")
    with pytest.raises(ConfigError, match=re.escape(
            f"data.eval_file={questions}: none of its 1 rows is usable; the first: {questions}:1: missing prompt "
            "field 'prompt'; set data.prompt_field to the field that holds the prompt text (this row has ['answer', "
            "'question'])")):
        check_prompt_files(cfg)
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={chat}", f"data.eval_file={questions}",
                                   "data.messages_field=messages", "data.prompt_field=question"))


def test_the_pre_launch_check_is_one_line_naming_the_key_file_row_and_field(tmp_path):
    good = write_parquet(verl_gsm8k_rows(3), tmp_path / "train.parquet")
    rows = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "What is 2 + 3?", "solution": "5"}]
    broken = write_jsonl(rows, tmp_path / "eval.jsonl")
    cfg = grpo_config(tmp_path, f"data.train_file={good}", f"data.eval_file={broken}", "data.on_bad_row=error")
    with pytest.raises(ConfigError) as raised:
        check_prompt_files(cfg)
    assert str(raised.value) == (
        f"data.eval_file={broken}: {broken}:2: missing answer field 'answer'; set data.answer_field to the field "
        "that holds the answer (this row has ['prompt', 'solution'])")
    # skip (the default): the bad row is left for the ranks to skip and report; a file of no usable row stops here
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={good}", f"data.eval_file={broken}"))
    cfg = grpo_config(tmp_path, f"data.train_file={good}", "data.answer_field=reward_model.truth")
    with pytest.raises(ConfigError, match=rf"data.train_file={good}: none of its 3 rows is usable; the first: "
                                          rf"{good}:row 1: missing answer field 'reward_model.truth' \(no field "
                                          r"'reward_model.truth'"):
        check_prompt_files(cfg)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=rf"data.train_file={tmp_path}/x.csv: unsupported suffix '.csv' of x.csv"):
        check_paths(grpo_config(tmp_path, f"data.train_file={tmp_path / 'x.csv'}"))
    with pytest.raises(ConfigError, match=rf"data.eval_file={tmp_path}/absent: no such file or folder"):
        check_paths(grpo_config(tmp_path, f"data.train_file={good}", f"data.eval_file={tmp_path / 'absent'}"))
    with pytest.raises(ConfigError, match=r"data.format='alpaca': expected one of"):
        grpo_config(tmp_path, f"data.train_file={good}", "data.format=alpaca")


def test_conversations_with_the_chat_template_on_need_a_tokenizer_that_has_one(tmp_path):
    chat = write_jsonl([{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}],
                       tmp_path / "trl.jsonl")
    cfg = grpo_config(tmp_path, f"data.train_file={chat}", "data.chat_template=true")
    with pytest.raises(ConfigError, match=rf"data.train_file={chat} holds conversations \(trl \(detected\): "
                                          rf"conversation in 'prompt', answer in 'answer'\) and data.chat_template=true, "
                                          rf"but the tokenizer in {cfg.model.hf_config} has no chat template"):
        check_prompt_files(cfg)
    check_prompt_files(grpo_config(tmp_path, f"data.train_file={chat}"))  # null: the one turn is given as its text
    (Path(cfg.model.hf_config) / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    check_prompt_files(cfg)


def test_without_a_chat_template_only_one_turn_conversations_are_read_before_and_after_launch(tmp_path,
                                                                                              plain_tokenizer):
    system = {"role": "system", "content": "Solve it."}
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
            {"prompt": [system, {"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]
    path = write_jsonl(rows, tmp_path / "trl.jsonl")
    why = (f"{path}:2: prompt: a conversation of 2 turns (system, user) is rendered by a chat template, and the "
           "tokenizer has none")
    with pytest.raises(BadRowError, match=re.escape(why)):
        load(path, plain_tokenizer)  # the ranks' loader
    with pytest.raises(ConfigError, match=re.escape(f"data.train_file={path}: {why}")):
        check_prompt_files(grpo_config(tmp_path, f"data.train_file={path}", "data.on_bad_row=error"))
    [record] = load_prompt_dataset(path, plain_tokenizer, prompt_length=400, use_chat_template=None).records
    assert record.prompt == "What is 2 + 3?"


def test_sft_rows_take_dotted_fields_and_folders_too(tmp_path):
    from grpo_mega.config.sft import SFTDataConfig
    from grpo_mega.sft import check_sft_row, sft_messages

    data = SFTDataConfig(train_file=str(tmp_path), prompt_field="q.text", response_field="a.text")
    row = {"q": {"text": "What is 2 + 3?"}, "a": {"text": "5"}}
    assert check_sft_row(row, data) is None
    assert sft_messages(row, data) == [{"role": "user", "content": "What is 2 + 3?"},
                                       {"role": "assistant", "content": "5"}]
    assert "response field 'a.text' must be a string, got 5" in check_sft_row({**row, "a": {"text": 5}}, data)
    assert "missing response field 'a.text' (no field 'a.text': 'a' has the fields ['txt'])" in check_sft_row(
        {**row, "a": {"txt": "5"}}, data)


@pytest.mark.parametrize("kind", ["parquet", "arrow_stream", "arrow_file"])
def test_tables_are_read_a_batch_at_a_time_with_rows_numbered_across_batches(tmp_path, monkeypatch, kind):
    """Rows are read a record batch at a time (2 rows here): their numbers run on across batches and row groups, so
    the row an error names is the file's row, and a reader that takes the first rows gets them."""
    import itertools

    import pyarrow.ipc as ipc

    from grpo_mega.data import sources

    monkeypatch.setattr(sources, "TABLE_BATCH_ROWS", 2)
    table = pyarrow.Table.from_pylist([{"prompt": f"p{i}", "answer": i} for i in range(7)])
    path = tmp_path / ("data.parquet" if kind == "parquet" else "data.arrow")
    if kind == "parquet":
        parquet.write_table(table, path, row_group_size=3)
    else:
        with pyarrow.OSFile(str(path), "wb") as sink:
            writer = (ipc.new_stream if kind == "arrow_stream" else ipc.new_file)(sink, table.schema)
            for batch in table.to_batches(max_chunksize=3):
                writer.write_batch(batch)
            writer.close()
    rows = list(sources.read_rows(path))
    assert [location for location, _, _ in rows] == [f"{path}:row {n}" for n in range(1, 8)]
    assert [row["answer"] for _, row, _ in rows] == list(range(7))
    first = list(itertools.islice(sources.read_rows(path), 2))
    assert [row["prompt"] for _, row, _ in first] == ["p0", "p1"]


@pytest.mark.parametrize("name", ["broken.parquet", "broken.arrow"])
def test_a_file_that_is_no_table_is_one_error_naming_it(tmp_path, name):
    """A damaged or mislabelled parquet / Arrow file: one DataSourceError naming the file (the command's preflight
    prints it as one line), not pyarrow's traceback."""
    from grpo_mega.data.sources import DataSourceError, read_rows

    path = tmp_path / name
    path.write_text("not a table")
    with pytest.raises(DataSourceError, match=rf"{path}: not a readable (parquet|arrow) file \("):
        list(read_rows(path))
