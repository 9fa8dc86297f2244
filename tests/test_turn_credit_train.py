"""``grpo-mega train`` with turn credit (``process_reward.steps=turns``) end to end, one step per step-reward source
(the oracle, the tools, a likelihood PRM, the implicit PRM, the tree by turns):
the scripted calculator policy of tests/test_turn_loop_train.py (every rollout: a call turn ``6 * 7``, the tool turn,
then "The answer is 42." or "... 41." at a coin flip) on rows whose chain is ``6 * 7 = 42``; the hf engine, one
process. Each run's dumped rollouts carry the advantages the update trained on: they are 0 on every tool token,
non-zero on every model token of a group whose outcomes differ, and equal to the turn-credit formulas of
docs/training.md worked here in plain Python from the dumped outcomes and turn rewards.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from test_turn_loop_train import CONFIG, RUNNER, build_bigram_policy
from tiny_task import build_tiny_task

STEPS = [{"lhs": 6, "op": "*", "rhs": 7, "result": 42}]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("turn_credit_task")
    model_dir, train_file = build_tiny_task(root)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()][:16]
    chain_file = root / "chain.jsonl"  # the tiny task's prompts, each asking for the policy's one chain
    chain_file.write_text("".join(json.dumps({"prompt": row["prompt"], "answer": "42", "steps": STEPS}) + "\n"
                                  for row in rows))
    return build_bigram_policy(model_dir, root / "bigram"), chain_file, root


def reference(group, form, weight, bound):
    """The advantages of one group by the formulas (grpo_mega.algo.turn_credit's docstring), from its dumped lines."""
    def stats(values):
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        return mean, std

    mean, std = stats([line["reward"] for line in group])
    outcome = [(line["reward"] - mean) / (std + 1e-6) for line in group]
    pooled_mean, pooled_std = stats([r for line in group for r in line["step_rewards"]])
    out = []
    for line, a in zip(group, outcome):
        z = [(r - pooled_mean) / (pooled_std + 1e-6) for r in line["step_rewards"]]
        spans = [(turn["start"], turn["end"]) for turn in line["turns"]]
        if form == "bounded":
            u = [max(-bound, min(bound, weight * value)) for value in z]
            lengths = [end - start for start, end in spans]
            centre = sum(n * v for n, v in zip(lengths, u)) / sum(lengths)
            per_turn = [a * (1 + v - centre) for v in u]
        else:
            per_turn = [a + weight * sum(z[k:]) for k in range(len(z))]
        advantages = [0.0] * len(line["response_ids"])
        for (start, end), value in zip(spans, per_turn):
            advantages[start:end] = [value] * (end - start)
        out.append(advantages)
    return out


SOURCES = {  # source: (overrides, turn credit form, weight)
    "function": (["reward.function=tool_task_turns", "process_reward.source=function"], "bounded", 1.0),
    "tool": (["reward.function=synthetic", "process_reward.source=tool", "process_reward.tool_success_reward=0.5"],
             "sum", 0.5),
    "prm": (["reward.function=synthetic", "process_reward.source=prm", "process_reward.layout=likelihood"],
            "bounded", 4.0),
    # PRIME's implicit PRM updated on the batch's outcomes before it scores (so its token rewards are not all 0)
    "implicit": (["reward.function=synthetic", "process_reward.source=implicit", "implicit_prm.update=before",
                  "implicit_prm.optim.lr=1e-2"], "sum", 1.0),
    # the tree by turns: 2 first turns per prompt, each continued twice after its tool turn (4 leaves, G)
    "tree": (["reward.function=synthetic", "process_reward.source=tree", "tree_rollout.branching=[2,2]",
              "process_reward.step_reward=progress"], "bounded", 1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_turn_credit_trains_on_model_tokens_with_the_turns_rewards(task, tmp_path, source):
    model_dir, train_file, root = task
    extra, form, weight = SOURCES[source]
    run_dir = tmp_path / "run"
    overrides = [
        f"model.hf_config={model_dir}", f"model.init_from={model_dir}", f"data.train_file={train_file}",
        f"trainer.run_dir={run_dir}", "algorithm.rollout_batch_size=2", "algorithm.num_return_sequences_in_group=4",
        "algorithm.response_length=16", "algorithm.dynamic_sampling=false", "trainer.total_steps=1",
        "trainer.eval_every=0", "trainer.dump_rollouts=true", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "parallel.device=cpu", "parallel.tensor=1", "rollout.engine=hf",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=3",
        "algorithm.supervision=process", "process_reward.steps=turns", f"algorithm.turn_credit={form}",
        f"algorithm.turn_credit_weight={weight}", f"process_reward.prm={model_dir}", *extra,
    ]
    runner = RUNNER.format(tests=str(Path(__file__).parent), root=str(root))
    done = subprocess.run([sys.executable, "-c", runner, "train", "--config", str(CONFIG), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]

    lines = [json.loads(line) for line in (run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    for line in lines:  # two turn steps each, ending at each turn's last model token
        call, answer = line["turns"]
        assert line["step_ends"] == [call["end"] - 1, answer["end"] - 1]
    if source == "function":  # the oracle: the call is the chain's operation; the answer turn is right iff 42
        for line in lines:
            assert line["step_rewards"] == [1.0, line["score"]]
    elif source == "tool":  # a call that ran (the calculator gives no reward of its own), then the answer turn
        assert all(line["step_rewards"] == [0.5, 0.0] for line in lines)
    elif source == "implicit":  # a turn's reward: its model tokens' implicit rewards summed
        assert any(r != 0 for line in lines for r in line["step_rewards"])
    elif source == "tree":  # progress: the call turn's node value minus the group's mean, then the outcome's rest
        for g in range(2):
            group = lines[4 * g: 4 * g + 4]
            mean = sum(line["reward"] for line in group) / 4
            for line in group:
                assert len(line["tree_path"]) == 2  # it branched after the call's tool turn
                node = [x["reward"] for x in group if x["tree_path"][0] == line["tree_path"][0]]
                assert len(node) == 2
                assert line["step_rewards"] == pytest.approx([sum(node) / 2 - mean, line["reward"] - sum(node) / 2])
        assert rows_logged(run_dir)["rollout/tree/nodes"] == 2 * (2 + 4)
    else:  # the PRM reads each turn in context: every rollout's first turn is the same text, so the same score
        firsts = {round(line["step_rewards"][0], 6) for line in lines}
        assert len(firsts) == 1 and all(0 < r <= 1 for line in lines for r in line["step_rewards"])
    rows = read_metrics_rows(run_dir)
    assert rows[0]["turn_credit/turns_scored"] == 16 and rows[0]["turn_credit/turns_per_completion"] == 2
    for g in range(2):
        group = lines[4 * g: 4 * g + 4]
        want = reference(group, form, weight, 0.25)
        outcomes_differ = len({line["reward"] for line in group}) > 1
        for line, expected in zip(group, want):
            assert line["advantages"] == pytest.approx(expected, abs=1e-4)
            for mask, value in zip(line["response_mask"], line["advantages"]):
                if mask == 0:
                    assert value == 0.0  # tool tokens carry no credit
                elif outcomes_differ:
                    assert value != 0.0
        if outcomes_differ and form == "bounded":  # the bound: each token keeps its outcome's sign
            for line in group:
                sign = math.copysign(1, line["reward"] - sum(x["reward"] for x in group) / 4)
                assert all(v * sign > 0 for v, m in zip(line["advantages"], line["response_mask"]) if m)


def rows_logged(run_dir: Path) -> dict:
    return read_metrics_rows(run_dir)[0]


def read_metrics_rows(run_dir: Path) -> list[dict]:
    from grpo_mega.run.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")
