"""The peers' tool data and rewards train as they are (issue 75, part 3): a verl parquet of tool-agent rows
(``agent_name: tool_agent``, per-row tool arguments in ``extra_info.tools_kwargs``) with a user tool whose
keyword-only argument comes from the row, scored by a verl ``compute_score`` (``solution_str``: the trajectory with
its tool turns) and a TRL reward function (conversational rows: ``completions`` are message lists with the
``role: tool`` messages in them), through ``grpo-mega train`` with test_turn_loop_train.py's scripted bigram policy,
which calls ``calculator`` with ``6 * 7`` and then answers 42 or 41. And a verl tool-agent file without
``rollout.multi_turn`` is refused before launch, naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow
import pyarrow.parquet as parquet
import pytest

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.config.preflight import check_agent_rows
from grpo_mega.run.metrics import read_metrics
from cli_runner import run_grpo_mega
from test_turn_loop_train import build_bigram_policy
from tiny_task import build_tiny_task

TESTS = Path(__file__).resolve().parent
CONFIG = TESTS.parent / "configs" / "quickstart_grpo.yaml"
ROW_TOOL = '''
def calculator(expression: str, *, offset: int = 0) -> str:
    """Evaluates an arithmetic expression, plus the row's offset.

    Args:
        expression: The expression, for example 6 * 7.
    """
    from grpo_mega.tools.calculator import calculate

    return str(int(calculate(expression)) + offset)
'''
REWARDS = '''
def offset_of(extra_info):
    return extra_info["tools_kwargs"]["calculator"]["create_kwargs"]["offset"]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form: the trajectory as text, the tool turn in it."""
    assert data_source == "tools/calculator"
    return float(solution_str.endswith(f"The answer is {ground_truth}."))


def tool_output(completions, extra_info, **kwargs):
    """TRL's form: 1 where the rollout's tool message holds 6 * 7 plus the row's offset."""
    return [float(len(c) > 1 and c[1]["role"] == "tool" and c[1]["name"] == "calculator"
                  and c[1]["content"] == str(42 + offset_of(info))) for c, info in zip(completions, extra_info)]
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_peer_data")
    model_dir, train_file = build_tiny_task(root)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    verl = [{"data_source": "tools/calculator", "agent_name": "tool_agent",
             "prompt": [{"role": "user", "content": row["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "42"},
             "extra_info": {"index": index, "tools_kwargs": {"calculator": {"create_kwargs": {"offset": index % 3}}}}}
            for index, row in enumerate(rows)]
    parquet.write_table(pyarrow.Table.from_pylist(verl), root / "tool_agent.parquet")
    (root / "row_tools.py").write_text(ROW_TOOL)
    (root / "peer_rewards.py").write_text(REWARDS)
    return build_bigram_policy(model_dir, root / "bigram"), root / "tool_agent.parquet", root


def _overrides(task, run_dir, *extra):
    model_dir, train_file, _ = task
    return [f"model.hf_config={model_dir}", f"model.init_from={model_dir}", f"data.train_file={train_file}",
            f"trainer.run_dir={run_dir}", "algorithm.rollout_batch_size=3", "algorithm.num_return_sequences_in_group=4",
            "algorithm.response_length=16", "algorithm.dynamic_sampling=false", "trainer.total_steps=2",
            "trainer.eval_every=0", "trainer.dump_rollouts=true", "trainer.progress_bar=false",
            "trainer.tensorboard=false", "parallel.device=cpu", "parallel.tensor=1", "rollout.engine=hf",
            "reward.functions=[peer_rewards.py:compute_score,peer_rewards.py:tool_output]", *extra]


@pytest.mark.slow
def test_verl_tool_agent_rows_and_a_trl_reward_on_tool_messages_train_as_they_are(task, tmp_path):
    run_dir = tmp_path / "run"
    done = run_grpo_mega("train", "--config", str(CONFIG),
                         *_overrides(task, run_dir, "rollout.multi_turn.enable=true",
                                     "rollout.multi_turn.tools=[row_tools.py:calculator]",
                                     "rollout.multi_turn.sandbox.workers=2"), cwd=task[2])
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "actor/pg_loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["tools/calls_per_rollout"] == 1 and row["tools/error_fraction"] == 0, row
        assert row["reward/tool_output/mean"] == 1.0, row  # every tool message had its row's offset
        assert 0 < row["reward/compute_score/mean"] < 1, row  # 42 or 41: the verl function read the answer
    dumped = [json.loads(line) for step in (1, 2)
              for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    outputs = {line["response"].split("<tool_response>")[1].split("</tool_response>")[0] for line in dumped}
    assert len(outputs) > 1 and outputs <= {"42", "43", "44"}  # each row's own tools_kwargs reached the tool


def test_a_verl_tool_agent_file_without_the_turn_loop_is_refused_naming_the_row(task, tmp_path):
    cfg = load_config(GRPOConfig, CONFIG, _overrides(task, tmp_path / "run"), validate)
    with pytest.raises(ConfigError, match=r"tool_agent\.parquet:row 1: agent_name 'tool_agent' .* "
                                          r"rollout\.multi_turn\.enable=true"):
        check_agent_rows(cfg)
    enabled = load_config(GRPOConfig, CONFIG, _overrides(task, tmp_path / "run", "rollout.multi_turn.enable=true",
                                                         "rollout.multi_turn.tools=[calculator]"), validate)
    check_agent_rows(enabled)
