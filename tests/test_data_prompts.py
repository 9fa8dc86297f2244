"""Prompt datasets: jsonl/parquet loading, bad-row reporting (file:line), skip/error switch, over-long prompts,
chat template vs format string, and resumable deterministic batches."""

import json
import logging
import sys

import pytest

from grpo_mega.data.prompts import BadRowError, PromptBatches, PromptFormatter, load_prompt_dataset
from grpo_mega.data.synthetic import generate_problems, task_texts, write_jsonl
from grpo_mega.data.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    return train_tokenizer(task_texts(generate_problems(300, seed=0)), folder)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def messy_jsonl(tmp_path):
    return write_lines(
        tmp_path / "messy.jsonl",
        [
            json.dumps({"prompt": "Q: Start with 2. Add 3. A:", "answer": "5", "id": 7}),  # line 1: good
            '{"prompt": "Q: Start with 2. A:", "answer": ',  # line 2: truncated JSON
            json.dumps({"question": "Q: 1 A:", "answer": "1"}),  # line 3: no prompt field
            "",  # line 4: blank, ignored
            json.dumps(["not", "an", "object"]),  # line 5
            json.dumps({"prompt": "Q: Start with 4. Add 4. A:", "answer": 8}),  # line 6: good, numeric answer
            json.dumps({"prompt": "Q: Start with 4. A:"}),  # line 7: no answer
        ],
    )


def test_jsonl_skip_reports_file_and_line(messy_jsonl, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_mega.data.prompts"):
        dataset = load_prompt_dataset(messy_jsonl, tokenizer, prompt_length=64, on_bad_row="skip")
    assert [r.source for r in dataset.records] == [f"{messy_jsonl}:1", f"{messy_jsonl}:6"]
    assert [r.answer for r in dataset.records] == ["5", "8"]
    assert dataset.records[0].extra == {"id": 7}
    assert [s.split(": ", 1)[0] for s in dataset.skipped] == [f"{messy_jsonl}:{n}" for n in (2, 3, 5, 7)]
    assert "invalid JSON" in dataset.skipped[0]
    assert "missing prompt field 'prompt'" in dataset.skipped[1]
    assert "expected a JSON object" in dataset.skipped[2]
    assert "missing answer field 'answer'" in dataset.skipped[3]
    assert "skipped 4 of 6 rows" in caplog.text


def test_jsonl_error_mode_names_the_first_bad_line(messy_jsonl, tokenizer):
    with pytest.raises(BadRowError, match=rf"{messy_jsonl.name}:2: invalid JSON"):
        load_prompt_dataset(messy_jsonl, tokenizer, prompt_length=64, on_bad_row="error")


def test_custom_field_names_and_no_answer(tmp_path, tokenizer):
    path = write_lines(tmp_path / "q.jsonl", [json.dumps({"question": "Q: Start with 3. A:", "gold": "3"})])
    dataset = load_prompt_dataset(path, tokenizer, prompt_length=64, prompt_field="question", answer_field="gold")
    assert (dataset.records[0].raw_prompt, dataset.records[0].answer) == ("Q: Start with 3. A:", "3")
    dataset = load_prompt_dataset(path, tokenizer, prompt_length=64, prompt_field="question", answer_field=None)
    assert dataset.records[0].answer is None and dataset.records[0].extra == {"gold": "3"}


def test_over_long_prompts(tmp_path, tokenizer):
    short, long = "Q: Start with 2. A:", "Q: Start with 2. " + "Add 1. " * 30 + "A:"
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": p, "answer": "1"}) for p in (short, long)])
    limit = len(tokenizer.encode(short))
    dataset = load_prompt_dataset(path, tokenizer, prompt_length=limit)
    assert [r.raw_prompt for r in dataset.records] == [short]
    assert dataset.records[0].prompt_ids == tokenizer.encode(short)
    assert f"p.jsonl:2: prompt has {len(tokenizer.encode(long))} tokens, more than prompt_length={limit}" in dataset.skipped[0]
    with pytest.raises(BadRowError, match="p.jsonl:2: prompt has"):
        load_prompt_dataset(path, tokenizer, prompt_length=limit, on_bad_row="error")


def test_all_rows_bad_is_an_error(tmp_path, tokenizer):
    path = write_lines(tmp_path / "bad.jsonl", ["{", "["])
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompt_dataset(path, tokenizer, prompt_length=64)


def test_settings_are_validated(messy_jsonl, tmp_path, tokenizer):
    with pytest.raises(ValueError, match="on_bad_row"):
        load_prompt_dataset(messy_jsonl, tokenizer, prompt_length=64, on_bad_row="ignore")
    with pytest.raises(ValueError, match="unsupported suffix '.csv'"):
        load_prompt_dataset(write_lines(tmp_path / "x.csv", ["a"]), tokenizer, prompt_length=64)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompt_dataset(tmp_path / "missing.jsonl", tokenizer, prompt_length=64)
    with pytest.raises(ValueError, match="prompt_format"):
        PromptFormatter(tokenizer, prompt_format="Q: {question}")


def test_parquet(tmp_path, tokenizer):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    rows = {"prompt": ["Q: Start with 2. A:", None, "Q: Start with 5. A:"], "answer": ["2", "0", "5"]}
    path = tmp_path / "data.parquet"
    parquet.write_table(pyarrow.table(rows), path)
    dataset = load_prompt_dataset(path, tokenizer, prompt_length=64)
    assert [r.source for r in dataset.records] == [f"{path}:row 1", f"{path}:row 3"]
    assert dataset.skipped == [f"{path}:row 2: prompt field 'prompt' must be a non-empty string, got None"]


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="needs pyarrow"):
        load_prompt_dataset(path, tokenizer, prompt_length=64)


def test_format_string_and_chat_template(tmp_path, tokenizer):
    formatter = PromptFormatter(tokenizer, prompt_format="Q: {prompt} A:")
    assert not formatter.uses_chat_template
    assert formatter("Start with 2.")[0] == "Q: Start with 2. A:"
    templated = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    templated.chat_template = "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}{% endfor %} A:"
    text, ids = PromptFormatter(templated, prompt_format="Q: {prompt} A:")("Start with 2.")
    assert text == "<s>[user] Start with 2. A:"
    assert ids[0] == templated.bos_token_id and ids.count(templated.bos_token_id) == 1
    # The switch turns the template off even when the tokenizer has one.
    assert PromptFormatter(templated, use_chat_template=False, prompt_format="Q: {prompt} A:")("x")[0] == "Q: x A:"


def test_synthetic_jsonl_loads_with_the_generic_loader(tmp_path, tokenizer):
    problems = generate_problems(10, seed=2)
    dataset = load_prompt_dataset(write_jsonl(problems, tmp_path / "train.jsonl"), tokenizer, prompt_length=64)
    assert [r.prompt for r in dataset.records] == [p.prompt for p in problems]
    assert [r.answer for r in dataset.records] == [str(p.answer) for p in problems]
    assert dataset.records[0].extra["steps"][0]["lhs"] == problems[0].start


def test_batches_cover_each_epoch_once_and_reshuffle():
    batches = PromptBatches(list(range(12)), batch_size=4, seed=5)
    epoch0 = [next(batches) for _ in range(3)]
    epoch1 = [next(batches) for _ in range(3)]
    assert sorted(sum(epoch0, [])) == list(range(12)) == sorted(sum(epoch1, []))
    assert epoch0 != epoch1 and batches.epoch == 1
    assert [next(PromptBatches(list(range(12)), 4, seed=5)) for _ in range(1)] == epoch0[:1]
    unshuffled = PromptBatches(list(range(12)), batch_size=4, shuffle=False)
    assert next(unshuffled) == [0, 1, 2, 3]


def test_batches_drop_the_remainder_and_never_span_epochs():
    batches = PromptBatches(list(range(10)), batch_size=4, seed=0)
    assert batches.batches_per_epoch == 2
    seen = [next(batches) for _ in range(2)]
    assert len(set(sum(seen, []))) == 8
    next(batches)
    assert batches.epoch == 1 and batches.position == 4


def test_batches_resume_at_the_same_place():
    records = list(range(10))
    original = PromptBatches(records, batch_size=3, seed=1)
    for _ in range(4):  # into the second epoch
        next(original)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint file
    expected = [next(original) for _ in range(5)]
    resumed = PromptBatches(records, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(5)] == expected


def test_batches_reject_mismatched_state_and_bad_sizes():
    state = PromptBatches(list(range(10)), batch_size=3, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_records=10"):
        PromptBatches(list(range(11)), batch_size=3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=3"):
        PromptBatches(list(range(10)), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptBatches(list(range(3)), batch_size=4)


def test_sft_examples_share_the_bad_row_policy(tmp_path, tokenizer):
    from grpo_mega.config import SFTConfig
    from grpo_mega.sft import load_sft_examples

    path = write_lines(
        tmp_path / "sft.jsonl",
        [
            json.dumps({"prompt": "Q: Start with 2. Add 3. A:", "solution": " Step 1: 2 + 3 = 5. The answer is 5."}),
            '{"prompt": "Q:",',  # line 2: truncated JSON
            json.dumps({"prompt": "Q: Start with 2. A:"}),  # line 3: no solution
            json.dumps({"prompt": "Q: Start with 2. A:", "solution": " 1" * 200}),  # line 4: too long
            json.dumps({"prompt": "Q: Start with 2. A:", "solution": 2}),  # line 5: not text
        ],
    )
    cfg = SFTConfig()
    cfg.data.train_file, cfg.data.response_field, cfg.data.max_length = str(path), "solution", 64
    prompts, responses = load_sft_examples(cfg, tokenizer)
    assert len(prompts) == 1 and responses[0][-1] == tokenizer.eos_token_id
    cfg.data.on_bad_row = "error"
    cfg.data.train_file = str(write_lines(tmp_path / "row5.jsonl", [path.read_text().splitlines()[4]]))
    with pytest.raises(BadRowError, match=r"row5.jsonl:1: response field 'solution' must be a string, got 2"):
        load_sft_examples(cfg, tokenizer)
    cfg.data.train_file = str(path)
    assert tokenizer.decode(responses[0][:-1]) == " Step 1: 2 + 3 = 5. The answer is 5."
    cfg.data.on_bad_row = "error"
    with pytest.raises(BadRowError, match=r"sft.jsonl:2: invalid JSON"):
        load_sft_examples(cfg, tokenizer)
    cfg.data.on_bad_row, cfg.data.train_file = "skip", str(write_lines(tmp_path / "bad.jsonl", ["{"]))
    with pytest.raises(ValueError, match="no usable rows in .*bad.jsonl"):
        load_sft_examples(cfg, tokenizer)
