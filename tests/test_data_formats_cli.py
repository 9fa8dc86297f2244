"""Issue 60 (data) from the command line: a verl GSM8K parquet and a TRL conversational dataset train GRPO with no
override beyond naming the file, each beside an eval file of plain prompts read in its own format; a broken eval
file stops ``grpo-mega train`` before any rank starts: one line naming the file, the row and the field, exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow
import pyarrow.parquet as parquet
import pytest
from cli_runner import run_grpo_mega
from tiny_task import SMALL_RUN, build_tiny_task

from grpo_mega.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The tiny task's byte-level tokenizer writes this template with its own pieces (tests/test_grpo_chat_prompts.py).
TINY_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %} A:{% endif %}")
RUN = [*[item for item in SMALL_RUN if not item.startswith("parallel.tensor")], "reward.function=math_verify",
       "data.prompt_length=200", "trainer.total_steps=2", "trainer.dump_rollouts=true", "data.max_eval_prompts=4"]


def _write_jsonl(rows, path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The tiny synthetic task as a verl GSM8K parquet, a TRL conversational jsonl and a plain eval jsonl; its model
    folder, and a copy whose tokenizer has a chat template."""
    root = tmp_path_factory.mktemp("data_formats_cli")
    model_dir, train_file = build_tiny_task(root / "task")
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    questions = [row["prompt"].removeprefix("Q: ").removesuffix(" A:") for row in rows]
    verl = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{q} {GSM8K_INSTRUCTION}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(row["answer"])},
             "extra_info": {"split": "train", "index": index, "answer": row["solution"], "question": q}}
            for index, (q, row) in enumerate(zip(questions, rows))]
    parquet.write_table(pyarrow.Table.from_pylist(verl), root / "gsm8k_train.parquet")
    trl = [{"prompt": [{"role": "system", "content": "Solve it."}, {"role": "user", "content": row["prompt"]}],
            "solution": str(row["answer"])} for row in rows]
    plain = [{"prompt": row["prompt"], "answer": row["answer"]} for row in rows[:8]]
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = TINY_TEMPLATE
    chat_model = root / "chat_model"
    tokenizer.save_pretrained(chat_model)
    (chat_model / "config.json").write_text((model_dir / "config.json").read_text())
    return {"model": model_dir, "chat_model": chat_model, "verl": root / "gsm8k_train.parquet",
            "trl": _write_jsonl(trl, root / "trl_conversational.jsonl"), "plain": _write_jsonl(plain, root / "eval.jsonl")}


def _train(*overrides: str) -> subprocess.CompletedProcess:
    return run_grpo_mega("train", "--config", GRPO, *RUN, *overrides)


def _dumped(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "rollouts").glob("*.jsonl"))
            for line in path.read_text().splitlines()]


def test_a_verl_gsm8k_parquet_trains_beside_a_plain_eval_file(task, tmp_path):
    run_dir = tmp_path / "run"
    trained = _train(f"model.hf_config={task['model']}", f"data.train_file={task['verl']}",
                     f"data.eval_file={task['plain']}", f"trainer.run_dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "skipping" not in trained.stderr
    dumped = _dumped(run_dir)  # 2 steps x 4 prompts x 2 completions, each the user turn (no chat template here)
    assert len(dumped) == 2 * 4 * 2 and all(row["prompt"].endswith(GSM8K_INSTRUCTION) for row in dumped)
    assert all(row["source"].startswith(f"{task['verl']}:row ") for row in dumped)
    evaluated = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in row for row in evaluated)  # the plain eval file, read in its own format


def test_a_trl_conversational_dataset_trains_beside_a_plain_eval_file(task, tmp_path):
    run_dir = tmp_path / "run"
    trained = _train(f"model.hf_config={task['chat_model']}", f"data.train_file={task['trl']}",
                     f"data.eval_file={task['plain']}", f"trainer.run_dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    dumped = _dumped(run_dir)  # the chat template's rendering: the system turn, the question, its generation prompt
    assert dumped and all(row["prompt"].startswith("Solve it. Q: Start with ") and row["prompt"].endswith(" A: A:")
                          for row in dumped), dumped[:1]
    assert all(row["source"].startswith(f"{task['trl']}:") for row in dumped)
    evaluated = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in row for row in evaluated)


def test_a_broken_eval_file_stops_the_command_before_launch_in_one_line(task, tmp_path):
    broken = _write_jsonl([{"prompt": "Q: Start with 2. A:", "answer": "2"}, {"question": "Q: Start with 3. A:"}],
                          tmp_path / "eval.jsonl")
    run_dir = tmp_path / "run"
    failed = _train(f"model.hf_config={task['model']}", f"data.train_file={task['verl']}",
                    f"data.eval_file={broken}", "data.on_bad_row=error", f"trainer.run_dir={run_dir}")
    assert failed.returncode == 2, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"grpo-mega train: error: data.eval_file={broken}: {broken}:2: missing prompt field 'prompt'; "
                      "set data.prompt_field to the field that holds the prompt text (this row has ['question'])"]
    assert "WARNING" not in failed.stderr and not run_dir.exists()  # no rank started, no run folder made
