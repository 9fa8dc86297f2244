"""GRPO with the implicit PRM (``process_reward.source: implicit``, PRIME) end to end on 2 gloo processes at TP=2: it
trains and logs its metrics, resumes exactly after a SIGKILL (its weights and optimizer in each checkpoint), and the
CLI refuses what it cannot run in one line before any rank starts."""

import json
import subprocess

import pytest

from grpo_mega.cli import main
from grpo_mega.run.metrics import read_metrics
from test_trainer_hardening import (CONFIG, KILL_RUN, _checkpoint_tensors, _cli, assert_runs_equal,
                                    straight_and_killed_runs)
from tiny_task import build_tiny_task

IMPLICIT = ("algorithm.supervision=process", "process_reward.source=implicit", "implicit_prm.optim.lr=1e-3",
            "implicit_prm.beta=0.5",
            # the tiny task's random policy writes no final answer: with the answer guard every completion's reward
            # would be the missing answer's step (process_reward.missing_answer_score), and the test would see 0s
            "algorithm.answer_guard=false")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


@pytest.mark.parametrize("before_dynamic_sampling", [False, True])
def test_grpo_with_the_implicit_prm_trains_it_and_logs_its_metrics(task, tmp_path, before_dynamic_sampling):
    run_dir = tmp_path / "run"
    model_dir, train_file = task
    evaluation = (f"data.eval_file={train_file}", "data.max_eval_prompts=4", "trainer.eval_every=2")
    # the tiny random policy answers nothing right: every group's outcomes are equal, so dynamic sampling by outcomes
    # would drop them all; before it, the implicit PRM's step rewards keep the groups whose steps they split (from
    # step 1 on only when the update comes first: under update: after step 1's rewards are the reference's, all 0)
    order = (f"implicit_prm.before_dynamic_sampling={str(before_dynamic_sampling).lower()}",
             f"algorithm.dynamic_sampling={str(before_dynamic_sampling).lower()}",
             *(["implicit_prm.update=before"] if before_dynamic_sampling else []))
    result = subprocess.run(_cli(task, run_dir, *IMPLICIT, *evaluation, *order, "trainer.total_steps=2",
                                 "trainer.dump_rollouts=true"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["implicit_prm/loss"] > 0 and row["implicit_prm/grad_norm"] > 0
        assert row["implicit_prm/lr"] == pytest.approx(1e-3)
        assert 0 <= row["implicit_prm/outcome_accuracy"] <= 1 and row["implicit_prm/update_fraction"] == 1.0
        assert "implicit_prm/token_reward_mean" in row and row["timing_s/implicit_prm"] > 0
        assert row["reward/steps_per_completion"] >= 1
        if before_dynamic_sampling:  # inside the rollout stage, and groups of equal outcomes still train
            assert row["timing_s/implicit_prm"] < row["timing_s/gen"]
            assert row["rollout/zero_signal_group_fraction"] == 1.0 and row["rollout/kept_group_fraction"] > 0
    # every evaluation scores the held-out completions against the synthetic task's step checker; at step 0 the PRM
    # is its reference (r_t = 0): no step scores below 0, so no wrong step is ever predicted
    for row in (rows[0], rows[2]):
        assert 0 <= row["eval/implicit_prm/outcome_accuracy"] <= 1 and 0 <= row["eval/implicit_prm/step_accuracy"] <= 1
    assert rows[0]["eval/implicit_prm/step_f1"] == 0.0
    assert rows[0].get("eval/implicit_prm/processbench_correct_accuracy", 1.0) == 1.0
    # the first update moved the PRM off its reference (r_t = 0 at phi = ref): step 2's rewards are not all 0 (the
    # default, update: after, scores step 1 with the reference: test_..._resumes_exactly_after_a_kill)
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert any(reward != 0 for line in dumped for reward in line["step_rewards"])
    for line in dumped:
        assert len(line["step_rewards"]) == len(line["step_ends"])
        assert all(0 <= end < len(line["response_ids"]) for end in line["step_ends"])
    # each checkpoint holds the implicit PRM, trained (its optimizer state too)
    saved = run_dir / "checkpoints" / "step_000002" / "implicit_prm"
    assert (saved / "metadata.json").is_file()
    assert any(key.startswith("optimizer.") for key in _checkpoint_tensors(saved))


@pytest.fixture(scope="module")
def straight_after(task, tmp_path_factory):
    """The kill test's uninterrupted 4-step run under the default update order (after): also the run of the offload
    test that keeps its training state in place."""
    run_dir = tmp_path_factory.mktemp("implicit_after") / "straight"
    result = subprocess.run(_cli(task, run_dir, *IMPLICIT, *KILL_RUN, "implicit_prm.update=after"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("update", ["before", "after"])
def test_grpo_with_the_implicit_prm_resumes_exactly_after_a_kill(task, tmp_path, update, request):
    reference = request.getfixturevalue("straight_after") if update == "after" else None
    straight, interrupted, _ = straight_and_killed_runs(task, tmp_path, *IMPLICIT, *KILL_RUN,
                                                        f"implicit_prm.update={update}", straight=reference)
    assert_runs_equal(straight, interrupted, 4)
    expected, got = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    # after: step 1 is scored by the PRM before any update (its reference: every reward 0), later steps are not
    rewards = [row["implicit_prm/token_reward_mean"] for row in expected if row["step"] >= 1]
    assert len(rewards) == 4
    assert (abs(rewards[0]) < 1e-7) == (update == "after") and all(abs(reward) > 1e-6 for reward in rewards[1:])
    for name in ("implicit_prm/loss", "implicit_prm/grad_norm", "implicit_prm/token_reward_mean"):
        assert [row[name] for row in got] == pytest.approx([row[name] for row in expected], rel=1e-6, abs=1e-9), name
    import torch

    prm_a = _checkpoint_tensors(straight / "checkpoints" / "step_000004" / "implicit_prm")
    prm_b = _checkpoint_tensors(interrupted / "checkpoints" / "step_000004" / "implicit_prm")
    assert prm_a.keys() == prm_b.keys() and "embedding.word_embeddings.weight" in prm_a
    for key in prm_a:
        assert torch.equal(prm_a[key], prm_b[key]), key


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.supervision=outcome"], "process_reward.source=implicit needs algorithm.supervision=process"),
    (["implicit_prm.beta=0"], "implicit_prm.beta=0.0 must be > 0"),
    (["implicit_prm.optim.lr=0"], "implicit_prm.optim.lr=0.0 must be > 0"),
    (["process_reward.step_reward=progress"], "process_reward.step_reward=progress treats step scores as"),
    (["rollout.mode=async", "algorithm.rollout_is=tis", "implicit_prm.before_dynamic_sampling=true"],
     "implicit_prm.before_dynamic_sampling=true runs the implicit PRM inside the rollout stage"),
    (["engine=deepspeed", "parallel.tensor=1"], "process_reward.source=implicit needs engine=megatron"),
    (["implicit_prm.accuracy_low=0.9", "implicit_prm.accuracy_high=0.5"], "implicit_prm.accuracy_low=0.9 and"),
    (["implicit_prm.step_value=tokens"], "implicit_prm.step_value='tokens': expected one of"),
    (["implicit_prm.update=later"], "implicit_prm.update='later': expected one of"),
    (["implicit_prm.init_from=/no/such/folder"], "implicit_prm.init_from=/no/such/folder: no such folder"),
])
def test_the_cli_refuses_what_the_implicit_prm_cannot_run_in_one_line(task, tmp_path, capsys, overrides, message):
    model_dir, train_file = task
    status = main(["train", "--config", str(CONFIG), "--nproc", "2", f"model.hf_config={model_dir}",
                   f"data.train_file={train_file}", f"trainer.run_dir={tmp_path / 'run'}",
                   "process_reward.source=implicit",
                   "algorithm.supervision=process", *overrides])
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err


def test_offloading_the_training_state_during_rollout_changes_nothing(task, straight_after, tmp_path):
    """parallel.offload_during_rollout moves the implicit PRM's optimizer state to the host with the policy's and
    brings it back for its update: every step's losses, gradient norms and rewards, and the final weights of policy
    and implicit PRM, equal a run that kept it (the kill test's uninterrupted run, the same settings)."""
    import torch
    from test_async_rollouts import _comparable

    offload = tmp_path / "offload_true"
    result = subprocess.run(_cli(task, offload, *IMPLICIT, *KILL_RUN, "implicit_prm.update=after",
                                 "parallel.offload_during_rollout=true"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    kept, offloaded = (read_metrics(run / "metrics.jsonl") for run in (straight_after, offload))
    assert len(kept) == 4 and all(row["implicit_prm/grad_norm"] > 0 for row in kept)
    assert [_comparable(row) for row in offloaded] == [_comparable(row) for row in kept]
    for part in ("", "implicit_prm"):
        a, b = (_checkpoint_tensors(run / "checkpoints" / "step_000004" / part) for run in (straight_after, offload))
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), part or "policy"


@pytest.mark.slow
def test_async_rollouts_train_the_implicit_prm_on_the_trainer_as_the_colocated_run_does(task, tmp_path):
    """rollout.mode=async at staleness 0: the rollout rank samples and filters, the trainer rank trains the implicit
    PRM and scores the batch; every batch, reward, implicit-PRM loss and policy update equals a colocated run's on
    one process, and its checkpoints hold the implicit PRM. (The held-out evaluation runs in the rollout world,
    which holds no implicit PRM: its eval/implicit_prm/* figures are the colocated run's only.)"""
    from test_async_rollouts import ASYNC, _command, _comparable, _run, _trained

    implicit = (*IMPLICIT, "trainer.total_steps=3", "trainer.save_every=2")
    colocated, separate = tmp_path / "colocated", tmp_path / "async"
    _run(_command(task, colocated, 1, "parallel.tensor=1", *implicit), OMP_NUM_THREADS="1")
    _run(_command(task, separate, 2, *ASYNC, "rollout.max_staleness=0", *implicit))
    expected, got = read_metrics(colocated / "metrics.jsonl"), read_metrics(separate / "metrics.jsonl")
    assert [row["step"] for row in got] == [0, 1, 2, 3]
    assert all(row["implicit_prm/loss"] > 0 for row in got[1:])
    assert "eval/implicit_prm/outcome_accuracy" in expected[0] and "eval/implicit_prm/outcome_accuracy" not in got[0]

    def same(row):
        return {k: v for k, v in _comparable(row).items() if not k.startswith("eval/implicit_prm/")}

    assert [same(row) for row in got] == [same(row) for row in expected]
    for step in (1, 2, 3):
        assert _trained(separate, step) == _trained(colocated, step)
    latest = (separate / "checkpoints" / "latest").read_text().strip()
    assert (separate / "checkpoints" / latest / "implicit_prm" / "metadata.json").is_file()
