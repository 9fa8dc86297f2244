"""The GRPO trainer end to end on 2 gloo processes (TP=2), for what a week-long run needs: an exact resume after
a kill, rewards that agree on every rank when the verifier does not, a non-finite step that stops the run naming
the step, and a schedule that follows the config when a run is extended."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dist_utils import run_distributed
from grpo_mega.run.metrics import read_metrics
from grpo_mega.run.shared_fork_server import offered_server_pid
from tiny_task import build_tiny_task, tiny_run_overrides

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _overrides(task, run_dir, *extra):
    return tiny_run_overrides(task, run_dir, "optim.lr=1e-3", *extra)


def _cli(task, run_dir, *extra):
    return [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "--nproc", "2",
            *_overrides(task, run_dir, *extra)]


def _checkpoint_tensors(folder: Path) -> dict:
    """Every tensor of a training checkpoint (torch_dist = torch.distributed.checkpoint), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent.parent / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    state = torch.load(target, weights_only=False)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors


def straight_and_killed_runs(task, root: Path, *common: str,
                             straight: Path | None = None) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """An uninterrupted 4-step run (``root/straight``, or the ``straight`` folder another test's fixture ran with the
    same ``common`` settings) and one killed mid step 3 after its step-2 save, then resumed (``root/interrupted``);
    returns the two run folders and the resumed command's result."""
    if straight is None:
        straight = root / "straight"
        done = subprocess.run(_cli(task, straight, *common), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    interrupted = root / "interrupted"
    latest = interrupted / "checkpoints" / "latest"
    with open(root / "first.log", "w") as log:
        job = subprocess.Popen(_cli(task, interrupted, *common), stdout=log, stderr=log, start_new_session=True)
        while job.poll() is None and not (latest.exists() and latest.read_text().strip() == "step_000002"):
            time.sleep(0.05)
        # The whole job, mid step 3, as a scheduler would: torchrun's workers run in their own process groups, forked
        # from the suite's shared fork server (no server of the job's own to start and preload), so not among the
        # launcher's descendants: rank_pid finds them (and a server of the job's own, its ranks, among those)
        _kill_with_descendants([job.pid, *filter(None, (_rank_pid(rank, interrupted) for rank in range(2)))])
        job.wait()
    assert latest.read_text().strip() == "step_000002", (root / "first.log").read_text()[-3000:]
    resumed = subprocess.run(_cli(task, interrupted, *common), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_000002" in resumed.stderr
    return straight, interrupted, resumed


def _rank_pid(rank: int, run_dir: Path) -> int | None:
    """The pid of ``rank`` of the job writing to ``run_dir``: bench/faults.py's rank_pid, told the shared server."""
    sys.path.insert(0, str(CONFIG.parents[1] / "bench"))
    from faults import rank_pid

    return rank_pid(rank, run_dir, b"grpo_mega.cli", shared_server=offered_server_pid())


def _kill_with_descendants(pids: list[int]) -> None:
    """SIGKILL the processes ``pids`` and all their descendants, listed first (none gets to start another)."""
    processes = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def assert_runs_equal(straight: Path, interrupted: Path, steps: int) -> dict:
    """The same completions, rewards, per-step figures and final weights in both run folders; returns the final
    checkpoint's tensors."""
    import torch

    for step in range(1, steps + 1):  # the same completions and rewards at every step
        name = f"rollouts/step_{step:06d}.jsonl"
        assert (straight / name).read_text() == (interrupted / name).read_text(), name
    expected, got = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    for name in ("actor/lr", "actor/grad_norm", "actor/pg_loss", "critic/score/mean"):
        assert [row[name] for row in got] == pytest.approx([row[name] for row in expected], rel=1e-6, abs=1e-9), name
    final_a = _checkpoint_tensors(straight / "checkpoints" / f"step_{steps:06d}")
    final_b = _checkpoint_tensors(interrupted / "checkpoints" / f"step_{steps:06d}")
    assert final_a.keys() == final_b.keys() and "embedding.word_embeddings.weight" in final_a
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key
    return final_a


KILL_RUN = ("trainer.total_steps=4", "trainer.save_every=2", "trainer.dump_rollouts=true", "optim.decay_style=cosine",
            "trainer.keep_last=3")


@pytest.fixture(scope="module")
def straight_run(task, tmp_path_factory):
    """The uninterrupted 4-step cosine run of :data:`KILL_RUN`: the kill test's reference, and the finished run the
    extension test copies and extends."""
    run_dir = tmp_path_factory.mktemp("straight") / "straight"
    done = subprocess.run(_cli(task, run_dir, *KILL_RUN), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_killed_and_resumed_run_equals_an_uninterrupted_one(task, straight_run, tmp_path):
    straight, interrupted, _ = straight_and_killed_runs(task, tmp_path, *KILL_RUN, straight=straight_run)
    assert_runs_equal(straight, interrupted, 4)
    # Each process's first step says where its start-up went (grpo_mega.perf.startup): from the command's start
    # (torchrun and the rank's process before it: launch), the rank's imports, ..., to the step.
    phases = {"launch", "imports", "distributed", "data", "model_build", "load", "rollout_engine", "other", "total"}
    expected, got = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    for rows, firsts in ((expected, {1}), (got, {1, 3})):  # the resumed process's first step is 3
        startup = [{k.split("/")[1]: v for k, v in row.items() if k.startswith("startup_s/")} for row in rows]
        assert [bool(s) for s in startup] == [row["step"] in firsts for row in rows]
        for first in filter(None, startup):
            # imports: the rank's own (torch, megatron-core and transformers come preloaded into a forked rank: launch)
            # launch: from the user's command (0.3 s since the agent's start-up cuts of 2026-12-08), not the rank's
            # own start (~0 for a forked rank)
            assert set(first) == phases and first["launch"] > 0.1 and first["imports"] > 0, first
            assert first["total"] == pytest.approx(sum(v for k, v in first.items() if k != "total"))


def rank_dependent_flaky_reward(prompt, completion, answer, **extra):
    """Depends on the rank that calls it and raises on some samples on rank 1 only."""
    import torch.distributed as dist

    if dist.get_rank() == 1 and len(completion) % 3 == 0:
        raise TimeoutError("verifier timed out")
    return float(len(completion) % 5) + 10.0 * dist.get_rank()


def _train_recording_batches(overrides):
    import hashlib

    import grpo_mega.trainer as trainer
    from grpo_mega.config import GRPOConfig, load_config, validate

    digests = []
    build = trainer.build_training_batch

    def recording_build(groups, algorithm, pad_id):
        batch = build(groups, algorithm, pad_id)
        digest = hashlib.sha256()
        for name in ("input_ids", "advantages", "loss_mask"):
            digest.update(batch[name].numpy().tobytes())
        digests.append(digest.hexdigest())
        return batch

    trainer.build_training_batch = recording_build
    trainer.train(load_config(GRPOConfig, CONFIG, overrides, validate))
    return digests


@pytest.mark.slow
def test_a_rank_dependent_failing_reward_gives_identical_batches_on_every_rank(task, tmp_path):
    run_dir = tmp_path / "run"
    overrides = _overrides(task, run_dir, "trainer.total_steps=3",
                           f"reward.function={__name__}:rank_dependent_flaky_reward")
    per_rank = run_distributed(_train_recording_batches, 2, overrides)
    assert len(per_rank[0]) == 3 and per_rank[0] == per_rank[1]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert sum(row["reward/failures"] for row in metrics) > 0  # the run went on past failing calls


NAN_FROM_STEP = 2


def _train_with_nan_loss_from_step_2(overrides):
    import grpo_mega.stages.update as update
    import grpo_mega.trainer as trainer
    from grpo_mega.config import GRPOConfig, load_config, validate
    from grpo_mega.engine.base import NonFiniteError

    current_step = [0]
    make_loss = update.grpo_loss_fn
    run_rollout = trainer.RolloutStage.run

    def poisoned_loss_fn(settings):
        loss_fn = make_loss(settings)

        def loss(outputs, micro, scale):
            value, metrics = loss_fn(outputs, micro, scale)
            return (value * math.nan if current_step[0] >= NAN_FROM_STEP else value), metrics

        return loss

    def rollout_noting_the_step(self, step):
        current_step[0] = step
        return run_rollout(self, step)

    update.grpo_loss_fn = poisoned_loss_fn
    trainer.RolloutStage.run = rollout_noting_the_step
    try:
        trainer.train(load_config(GRPOConfig, CONFIG, overrides, validate))
    except NonFiniteError as error:
        return str(error)
    return "finished"


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_is_recorded(task, tmp_path):
    run_dir = tmp_path / "run"
    overrides = _overrides(task, run_dir, "trainer.total_steps=3", "trainer.save_every=1")
    per_rank = run_distributed(_train_with_nan_loss_from_step_2, 2, overrides)
    for message in per_rank:
        assert message.startswith("step 2 ") and "non-finite" in message and "not applied" in message
    rows = {row["step"]: row for row in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(rows) == [1, 2] and math.isfinite(rows[1]["actor/loss"]) and math.isnan(rows[2]["actor/loss"])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    # metrics.jsonl holds the NaN as JSON NaN, as written
    assert "NaN" in (run_dir / "metrics.jsonl").read_text().splitlines()[-1]


@pytest.mark.slow
def test_extending_a_finished_cosine_run_trains_at_a_non_zero_lr(task, straight_run, tmp_path):
    """A finished 4-step cosine run (decayed to min_lr = 0 at its end) extended to 5 steps: the resumed step follows
    the 5-step schedule instead of the saved one."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    second = subprocess.run(_cli(task, run_dir, *KILL_RUN, "trainer.total_steps=5"), capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "follows the config" in second.stderr
    lrs = {row["step"]: row["actor/lr"] for row in read_metrics(run_dir / "metrics.jsonl")}
    # the resumed step is position 4 of a 5-step cosine: lr * (1 + cos(4 pi / 5)) / 2; the saved 4-step schedule had
    # run down to min_lr (0) at that position
    assert sorted(lrs) == [1, 2, 3, 4, 5]
    assert lrs[5] == pytest.approx(1e-3 * (1 + math.cos(math.pi * 4 / 5)) / 2, rel=1e-5) and lrs[5] > 1e-5
    assert json.loads((run_dir / "checkpoints" / "step_000005" / "grpo_mega_checkpoint.json").read_text())["step"] == 5


@pytest.mark.slow
def test_process_supervision_trains_from_the_synthetic_step_rewards(task, tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        _cli(task, run_dir, "trainer.total_steps=2", "reward.function=synthetic_steps", "algorithm.supervision=process",
             "trainer.dump_rollouts=true"),
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["reward/steps_per_completion"] >= 1 for row in rows)
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    for line in dumped:  # every non-empty completion has steps, each ending inside its response
        assert len(line["step_rewards"]) == len(line["step_ends"]) >= (1 if line["response"] else 0)
        assert all(0 <= end < len(line["response_ids"]) for end in line["step_ends"])
