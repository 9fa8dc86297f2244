"""Multi-turn tool rollouts (``rollout.multi_turn``) beyond one colocated process: ``rollout.mode: async`` (a training
rank and a rollout rank that runs the turn loop and its tools, one step of lag) and tensor and pipeline parallelism
(TP=2 and PP=2 on 2 gloo ranks, each running the turn loop on its share of the prompts). Each run is ``grpo-mega train`` from the command
line with test_turn_loop_train.py's scripted bigram policy, which calls the calculator once in every rollout and then
answers. What matters in each: the tool calls happened and came back (every rollout has its call, tool turn and
answer), the tool turn is out of the loss (mask 0 on it in every trained row; the sampler's and the trainer's
log-probs compared on the policy's tokens only), every step completed and moved the weights, and for async the fixed
lag holds (the batch of step n from weights n - 2, never staler); and an async run whose rollout rank is SIGKILLed
inside a tool call resumes to end as the uninterrupted one does (the batch in flight kept by the checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.run.metrics import read_metrics
from test_turn_loop_train import REWARD, build_bigram_policy
from tiny_task import build_tiny_task

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
STEPS = 3
ASYNC = ["rollout.mode=async", "parallel.tensor=1", "rollout.max_staleness=1", "algorithm.rollout_is=tis",
         "trainer.save_every=1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_parallel")
    model_dir, train_file = build_tiny_task(root)
    (root / "answer42.py").write_text(REWARD)
    return build_bigram_policy(model_dir, root / "bigram"), train_file, root


def _overrides(task, run_dir: Path, *extra: str) -> list[str]:
    model_dir, train_file, root = task
    return [
        f"model.hf_config={model_dir}", f"model.init_from={model_dir}", f"data.train_file={train_file}",
        f"trainer.run_dir={run_dir}", "algorithm.rollout_batch_size=2", "algorithm.num_return_sequences_in_group=4",
        "algorithm.response_length=16", "algorithm.dynamic_sampling=false", f"trainer.total_steps={STEPS}",
        "trainer.eval_every=0", "trainer.dump_rollouts=true", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "parallel.device=cpu", "rollout.engine=hf", "optim.lr=1e-3",
        f"reward.function={root / 'answer42.py'}:reward", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=3", *extra,
    ]


def _environment(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def _train(task, run_dir: Path, *extra: str) -> list[dict]:
    """``grpo-mega train`` on 2 processes; its metrics rows."""
    done = subprocess.run([sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "--nproc", "2",
                           *_overrides(task, run_dir, *extra)], capture_output=True, text=True, timeout=600,
                          cwd=task[2], env=_environment())
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "actor/pg_loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def async_run(task, tmp_path_factory):
    """An async run at staleness 1, a checkpoint every step, uninterrupted: (its folder, its metrics rows)."""
    run_dir = tmp_path_factory.mktemp("async") / "run"
    return run_dir, _train(task, run_dir, *ASYNC)


def _check_tool_rollouts(run_dir: Path, rows: list[dict]) -> None:
    """Every rollout of every step: the call, the calculator's answer (mask 0), the policy's answer; every step's
    metrics say so and the update moved the weights."""
    for row in rows:
        assert row["num_turns/min"] == row["num_turns/max"] == 2 and row["tools/calls_per_rollout"] == 1, row
        assert row["tools/error_fraction"] == 0 and 0 < row["tools/output_token_fraction"] < 1, row
        assert row["timing_s/tools"] >= 0 and row["actor/grad_norm"] > 0, row
    for step in range(1, STEPS + 1):
        dumped = [json.loads(line) for line in
                  (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(dumped) == 8
        for line in dumped:
            call, answer = line["turns"]
            assert call["calls"][0]["name"] == "calculator" and call["calls"][0]["error"] is None
            assert "<tool_response>42</tool_response>" in line["response"]
            assert line["response_mask"] == [1] * call["end"] + [0] * (call["tool_end"] - call["end"]) + \
                [1] * (answer["end"] - answer["start"])


@pytest.mark.slow
def test_async_rollouts_run_the_tools_on_the_rollout_rank_one_step_behind(async_run):
    run_dir, rows = async_run
    _check_tool_rollouts(run_dir, rows)
    assert [row["async/weights_version"] for row in rows] == [0, 0, 1]  # the batch of step n: weights max(n - 2, 0)
    assert max(row["async/staleness_max"] for row in rows) <= 1
    # off-policy by one step, the trainer's log-probs differ from the sampler's on the policy's tokens a little; a
    # tool token in the comparison (the sampler's 0 against the trainer's ~ -70 under this policy) would be tens
    assert all(row["rollout/logprob_diff_max"] < 5 for row in rows)
    assert rows[0]["rollout/logprob_diff_max"] < 1e-3  # step 1: weights 0 on both sides


@pytest.mark.slow
def test_tensor_parallel_ranks_each_run_the_turn_loop_and_train_on_policy_tokens_only(task, tmp_path):
    run_dir = tmp_path / "tp2"
    rows = _train(task, run_dir, "parallel.tensor=2")
    _check_tool_rollouts(run_dir, rows)
    # on policy: the sharded trainer's log-probs equal the sampler's on the policy's tokens (the tool's are masked)
    assert all(row["rollout/logprob_diff_max"] < 1e-3 for row in rows)


@pytest.mark.slow
def test_pipeline_stages_train_the_tool_rollouts_on_policy_tokens_only(task, tmp_path):
    """PP=2: the turn loop runs on the whole model (every rank's rollout engine), the loss and the log-probs on the
    last stage read the response mask like TP's."""
    model_dir, train_file, root = task
    deeper = (build_bigram_policy(model_dir, root / "bigram_2_layers", num_layers=2), train_file, root)
    run_dir = tmp_path / "pp2"
    rows = _train(deeper, run_dir, "parallel.tensor=1", "parallel.pipeline=2")
    _check_tool_rollouts(run_dir, rows)
    assert all(row["rollout/logprob_diff_max"] < 1e-3 for row in rows)


@pytest.mark.slow
def test_an_async_run_killed_in_a_tool_call_on_the_rollout_rank_resumes_exactly(task, async_run, tmp_path):
    """Rank 1 (the rollout world) SIGKILLs itself in the first tool call of the batch of step 3 (bench/fault_inject.py,
    under the launcher's forked ranks as bench/chaos.py runs it), once the trainer has published step 1's checkpoint
    (the rollout world generates step 3 from version 1 while the trainer saves step 1: unordered without the wait;
    a kill before the publish loses that save, as a crash would, and the resume starts over): the job ends; the same command resumes from the
    last checkpoint, whose batch in flight was generated before the kill, and ends equal to the uninterrupted run."""
    sys.path.insert(0, str(REPO / "bench"))
    from chaos_checks import comparable_metrics, compare_checkpoints

    whole, killed = async_run[0], tmp_path / "killed" / "run"
    command = [sys.executable, "-m", "grpo_mega.run.torchrun", "--standalone", "--nproc-per-node=2", "-m", "--",
               "bench.fault_inject", "train", "--config", str(CONFIG), *_overrides(task, killed, *ASYNC)]
    mark = tmp_path / "fired"
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO,
                           env=_environment(GRPO_FAULT="tool_kill:1:3", GRPO_FAULT_MARK=str(mark),
                                            GRPO_FAULT_AFTER=str(killed / "checkpoints" / "latest")))
    assert first.returncode != 0 and mark.exists(), first.stderr[-4000:]
    assert (killed / "checkpoints" / "latest").read_text().strip() in ("step_000001", "step_000002")
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=_environment())
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-4000:]
    assert comparable_metrics(killed) == comparable_metrics(whole)
    for step in range(1, STEPS + 1):
        trained = [(line["response"], line["response_mask"]) for line in
                   map(json.loads, (killed / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines())]
        expected = [(line["response"], line["response_mask"]) for line in
                    map(json.loads, (whole / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines())]
        assert trained == expected, step
    final = compare_checkpoints(*(run / "checkpoints" / f"step_{STEPS:06d}" for run in (killed, whole)))
    assert final["bit_equal"], final
