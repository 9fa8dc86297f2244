"""Issue 60: a reward function that cannot score the rows is found before launch (one line naming the function, the
row and the error; exit 2), and reward code from verl and TRL trains from the command line."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from cli_runner import run_grpo_mega
from tiny_task import SMALL_RUN, build_tiny_task

from grpo_mega.config import ConfigError, GRPOConfig
from grpo_mega.config.preflight import check_reward_on_rows

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def _rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _cfg(train_file, function, **data):
    cfg = GRPOConfig()
    cfg.data.train_file, cfg.reward.function = str(train_file), function
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def test_a_wrong_signature_is_named_with_the_row_before_launch(tmp_path):
    rows = _rows(tmp_path / "train.jsonl", [{"prompt": "2 + 2?", "answer": "4"}])
    module = _write(tmp_path / "r.py", """
        def compute_score(data_source, solution_str, ground_truth, index):  # a column the rows lack
            return 1.0
    """)
    with pytest.raises(ConfigError, match=rf"reward.function={module}:compute_score cannot score {rows}:1 "
                                          r"\(completion 'The answer is 4\.'\): TypeError: .*'index'"):
        check_reward_on_rows(_cfg(rows, f"{module}:compute_score"))


def test_a_return_value_that_is_no_reward_is_named(tmp_path):
    rows = _rows(tmp_path / "train.jsonl", [{"prompt": "2 + 2?", "answer": "4"}])
    module = _write(tmp_path / "r.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"acc": 1.0}
    """)
    with pytest.raises(ConfigError, match=f"{rows}:1 .*without a 'score' key"):
        check_reward_on_rows(_cfg(rows, f"{module}:compute_score"))


def test_verl_default_on_a_source_it_cannot_verify_names_it_and_the_row(tmp_path):
    rows = _rows(tmp_path / "train.parquet.jsonl", [
        {"prompt": "p", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "4"}},
        {"prompt": "p", "data_source": "codecontests", "reward_model": {"ground_truth": "[]"}}])
    with pytest.raises(ConfigError, match=f"{rows}:2 .*no verifier for data_source 'codecontests'"):
        check_reward_on_rows(_cfg(rows, "verl_default", answer_field="reward_model.ground_truth"))


def test_a_nested_answer_field_leaves_its_column_to_the_function(tmp_path):
    rows = _rows(tmp_path / "train.jsonl", [{"prompt": "p", "data_source": "openai/gsm8k",
                                             "reward_model": {"style": "rule", "ground_truth": "4"}}])
    module = _write(tmp_path / "r.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            assert ground_truth == "4" and kwargs["reward_model"]["style"] == "rule", (ground_truth, kwargs)
            return 1.0
    """)
    check_reward_on_rows(_cfg(rows, f"{module}:compute_score", answer_field="reward_model.ground_truth"))


def test_rows_that_every_function_scores_pass_parquet_and_trl_none_included(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    rows = [{"prompt": "p", "data_source": "openai/gsm8k", "extra_info": {"index": i},
             "reward_model": {"style": "rule", "ground_truth": str(i)}} for i in range(5)]
    path = tmp_path / "train.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    module = _write(tmp_path / "trl.py", """
        def not_applicable(completions, **kwargs):
            return [None for _ in completions]
    """)
    cfg = _cfg(path, "verl_default", answer_field="reward_model.ground_truth")
    cfg.reward.function, cfg.reward.functions = GRPOConfig().reward.function, ["verl_default", f"{module}:not_applicable"]
    check_reward_on_rows(cfg)


def test_train_refuses_a_reward_that_cannot_score_the_rows_in_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rows = _rows(tmp_path / "train.jsonl", [{"prompt": "2 + 2?", "answer": "4"}] * 3)
    module = _write(tmp_path / "r.py", """
        def reward(completions, **kwargs):
            return [kwargs["solution"] == c for c in completions]
    """)
    result = run_grpo_mega("train", "--config", GRPO, f"model.hf_config={model}", f"data.train_file={rows}",
                        f"reward.function={module}:reward", "reward.on_error=zero")
    assert result.returncode == 2, result.stderr[-2000:]
    line, = result.stderr.strip().splitlines()
    assert line.startswith("grpo-mega train: error: reward.function=") and f"{rows}:1" in line \
        and "KeyError: 'solution'" in line, line


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("reward_task") / "task")


def _train_two_steps(task, run_dir: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    model_dir, train_file = task
    small = [item for item in SMALL_RUN if not item.startswith("parallel.tensor")]
    return run_grpo_mega("train", "--config", GRPO, f"model.hf_config={model_dir}", f"data.train_file={train_file}",
                      f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "reward.on_error=raise", *small, *extra,
                      cwd=cwd)


def _failures(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["reward/failures"] for row in rows if "reward/failures" in row]


@pytest.mark.slow
def test_a_verl_compute_score_file_trains_from_the_command_line(task, tmp_path):
    _write(tmp_path / "verl_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            assert "steps" in kwargs  # the row's other columns
            return {"score": 1.0 if f"The answer is {ground_truth}." in solution_str else 0.0, "acc": 0.0}
    """)
    result = _train_two_steps(task, tmp_path / "run", "reward.function=verl_reward.py:compute_score", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _failures(tmp_path / "run") == [0.0, 0.0]


@pytest.mark.slow
def test_a_trl_function_in_the_current_folder_trains_with_one_process(task, tmp_path):
    _write(tmp_path / "trl_rewards.py", """
        def accuracy(completions, answer, **kwargs):
            return [float(f"The answer is {a}." in c) for c, a in zip(completions, answer)]
    """)
    result = _train_two_steps(task, tmp_path / "run", "reward.functions=[trl_rewards:accuracy, step_format]",
                              "--nproc", "1", "reward.weights=[1.0, 0.5]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _failures(tmp_path / "run") == [0.0, 0.0]
