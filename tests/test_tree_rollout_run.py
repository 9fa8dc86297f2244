"""GRPO with tree credit (``process_reward.source: tree``) end to end on 2 gloo processes at TP=2: every group is a
tree whose rows share their prefixes, the step rewards are node values, the tree's metrics are logged, a killed run
resumes to the same trees and weights, and the CLI refuses a branching that does not make the group in one line."""

import json
import os

import pytest

from grpo_mega.cli import main
from grpo_mega.run.metrics import read_metrics
from test_trainer_hardening import KILL_RUN, _cli, assert_runs_equal, straight_and_killed_runs
from tiny_task import build_tiny_task

TREE = ("algorithm.supervision=process", "process_reward.source=tree", "process_reward.step_reward=progress",
        "algorithm.step_baseline=completion", "tree_rollout.branching=[2,2]", "tree_rollout.segment_tokens=4",
        "algorithm.num_return_sequences_in_group=4", "reward.function=parity_reward:reward",
        # the random policy writes no final answer: the guard would score every completion's last step as a wrong
        # answer's, whatever its reward
        "algorithm.answer_guard=false")

# The tiny task's random policy never answers right; this reward differs between completions (their length's
# parity), so the trees' node values do too.
PARITY_REWARD = '''
def reward(prompt: str, completion: str, answer: str, **extra) -> float:
    return float(len(completion) % 2)
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The tiny task, with the parity reward importable by the command and its ranks (PYTHONPATH) for the module."""
    root = tmp_path_factory.mktemp("task")
    (root / "parity_reward.py").write_text(PARITY_REWARD)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        patch.syspath_prepend(str(root))
        yield build_tiny_task(root)


@pytest.mark.slow
def test_grpo_with_tree_credit_trains_on_trees_and_resumes_exactly_after_a_kill(task, tmp_path):
    straight, interrupted, _ = straight_and_killed_runs(task, tmp_path, *TREE, *KILL_RUN)
    assert_runs_equal(straight, interrupted, 4)  # the same trees, rewards and weights
    rows = read_metrics(straight / "metrics.jsonl")
    for row in rows:
        assert row["rollout/tree/leaves"] >= 4 and row["rollout/tree/nodes"] >= row["rollout/tree/leaves"]
        assert 1 <= row["rollout/tree/mean_depth"] <= 2 and row["timing_s/tree_sampling"] > 0
        assert row["rollout/generated_tokens"] == row["rollout/tree/generated_tokens"]
        assert "actor/pg_loss" in row
    dumped = [json.loads(line) for line in (straight / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dumped) == 4 * 4
    for begin in range(0, 16, 4):
        group = dumped[begin:begin + 4]
        assert len({line["prompt"] for line in group}) == 1
        assert {line["tree_path"][0] for line in group} == {0, 1}  # the root's two children
        for a, b in ((group[0], group[1]), (group[2], group[3])):  # siblings share their first segment
            assert a["tree_path"][0] == b["tree_path"][0] and a["response_ids"][:4] == b["response_ids"][:4]
        # progress rewards telescope: a row's step rewards sum to its outcome minus the group's mean outcome
        mean = sum(line["score"] for line in group) / 4
        for line in group:
            assert sum(line["step_rewards"]) == pytest.approx(line["score"] - mean, abs=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (("tree_rollout.branching=[2,3]",), "has 6 leaves but algorithm.num_return_sequences_in_group=4"),
    (("tree_rollout.segment_tokens=12",), "leaves none of algorithm.response_length=12"),
    (("algorithm.supervision=outcome",), "process_reward.source=tree needs algorithm.supervision=process"),
    (("algorithm.step_baseline=once",), "algorithm.step_baseline"),
])
def test_the_cli_refuses_a_tree_that_cannot_run_in_one_line(task, tmp_path, capsys, overrides, message):
    command = _cli(task, tmp_path / "run", *TREE, *overrides)
    status = main(command[3:])
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
