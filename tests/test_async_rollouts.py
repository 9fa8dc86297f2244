"""Asynchronous rollouts (``rollout.mode: async``): the job split into a training and a rollout world, the bridge
between them, the fixed-lag schedule, and the real CLI end to end on 2 gloo processes (1 training rank, 1 rollout
rank): k = 0 gives the colocated run's batches and metrics, k = 1 is killed and resumes exactly."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.parallel.roles import role_layout
from grpo_mega.rollout.base import Completion
from grpo_mega.rollout.bridge import pack_bucket, unpack_bucket
from grpo_mega.run.metrics import read_metrics
from grpo_mega.run.procfs import alive
from grpo_mega.run.shared_fork_server import offered_server_pid, without_offer
from grpo_mega.stages.rollout import RolloutBatch
from grpo_mega.stages.rollout_feed import batch_from_state, batch_state, generating_version
from tiny_task import build_tiny_task, tiny_run_overrides

TESTS = Path(__file__).resolve().parent
CONFIG = TESTS.parent / "configs" / "quickstart_grpo.yaml"
ASYNC = ["rollout.mode=async", "parallel.tensor=1"]


def digit_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """Share of digits in the completion: varies within a group even for a random policy, so every step updates."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0


# ----------------------------------------------------------------------------- pure parts
def test_the_last_ranks_generate_and_global_rank_0_trains():
    assert role_layout(0, 3, 1) == role_layout(0, 3, 1)
    first, second, last = (role_layout(rank, 3, 1) for rank in range(3))
    assert (first.role, first.rank, first.world_size, first.on_bridge) == ("train", 0, 2, True)
    assert (second.role, second.rank, second.world_size, second.on_bridge) == ("train", 1, 2, False)
    assert (last.role, last.rank, last.world_size, last.on_bridge, last.bridge_rank) == ("rollout", 0, 1, True, 1)
    spread = [role_layout(rank, 8, 4) for rank in range(8)]
    assert [(r.role, r.rank) for r in spread] == [("train", i) for i in range(4)] + [("rollout", i) for i in range(4)]
    for bad in (0, 3):
        with pytest.raises(ValueError, match="async_ranks"):
            role_layout(0, 3, bad)


def test_the_batch_of_step_n_is_generated_by_version_n_minus_1_minus_k():
    assert [generating_version(n, 0) for n in range(1, 6)] == [0, 1, 2, 3, 4]  # synchronous
    assert [generating_version(n, 1) for n in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [generating_version(n, 2) for n in range(1, 6)] == [0, 0, 0, 1, 2]


def test_a_bucket_crosses_the_bridge_bit_for_bit_whatever_its_dtypes():
    generator = torch.Generator().manual_seed(0)
    bucket = [("odd_bf16", torch.randn(3, 5, generator=generator).bfloat16()),  # 30 bytes: the next is realigned
              ("fp32", torch.randn(7, generator=generator)),
              ("empty", torch.zeros(0, 4)),
              ("ids", torch.arange(9, dtype=torch.int64).reshape(3, 3)),
              ("strided", torch.randn(4, 6, generator=generator).t())]  # not contiguous
    entries, buffer = pack_bucket(bucket)
    assert buffer.dtype == torch.uint8 and all(start % 16 == 0 for _, _, _, start, _ in entries)
    received = unpack_bucket(entries, buffer.clone())
    assert [name for name, _ in received] == [name for name, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_a_batch_in_flight_survives_the_checkpoint_format(tmp_path):
    record = PromptRecord("Q: 1+2? A:", [5, 6, 7], "3", "1+2?", "train.jsonl:4", {"level": 2})
    completions = [Completion(0, [5, 6, 7], [8, 9], [-0.5, -1.25], " 3", "eos"),
                   Completion(0, [5, 6, 7], [10], [-2.0], " x", "length")]
    batch = RolloutBatch([record], completions, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]),
                         [[0.9, 1.0], [0.1]], [[0, 1], [0]])
    path = tmp_path / "state.pt"
    torch.save({"batch": batch_state(batch)}, path)
    loaded = batch_from_state(torch.load(path, weights_only=True)["batch"])  # how checkpoints are read
    assert loaded.records == batch.records and loaded.completions == batch.completions
    assert torch.equal(loaded.rewards, batch.rewards) and torch.equal(loaded.scores, batch.scores)
    assert loaded.step_rewards == batch.step_rewards and loaded.step_ends == batch.step_ends


@pytest.mark.parametrize("overrides, world, message", [
    (["rollout.max_staleness=1", "algorithm.rollout_is=none"], 2, "set algorithm.rollout_is=tis"),
    (["parallel.offload_during_rollout=true", "rollout.max_staleness=0"], 2, "parallel.offload_during_rollout"),
    (["rollout.max_staleness=0"], 1, "leaves no training rank"),
    (["rollout.max_staleness=0", "rollout.async_ranks=1", "parallel.tensor=2"], 2, "not a multiple of"),
    (["rollout.max_staleness=0", "rollout.engine=vllm", "rollout.tensor_parallel=2", "rollout.async_ranks=1"], 3,
     "rollout.async_ranks=1 is not a multiple of rollout.tensor_parallel=2"),
    (["rollout.mode=later"], 2, "rollout.mode"),
])
def test_async_settings_that_cannot_run_are_refused_naming_the_key(overrides, world, message, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    base = ["model.hf_config=x", f"data.train_file={tmp_path / 'train.jsonl'}", "rollout.mode=async"]
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(GRPOConfig, CONFIG, base + overrides, validate)


# ----------------------------------------------------------------------------- end to end (the CLI)
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _command(task, run_dir, nproc, *extra):
    heldout = task[1].parent / "heldout.jsonl"
    return [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(CONFIG), "--nproc", str(nproc),
            *tiny_run_overrides(task, run_dir, "optim.lr=1e-3", f"reward.function={__name__}:digit_reward",
                                f"data.eval_file={heldout}", "trainer.eval_every=2", "trainer.dump_rollouts=true",
                                *extra)]


def _environment(**extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **extra}


def _run(command, timeout=300, **environment):
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_environment(**environment))
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _comparable(row):
    """A metrics row without what depends on the clock or the mode (timings, memory, the async metrics)."""
    skip = ("timing_s/", "startup_s/", "memory/", "async/", "perf/throughput")
    return {k: v for k, v in row.items() if k != "time" and not k.startswith(skip)}


def _trained(run_dir, step):
    return [(line["prompt"], line["response"]) for line in
            map(json.loads, (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def colocated_run(task, tmp_path_factory):
    """A 3-step colocated run on 1 process (its checkpoint: the last step's)."""
    run_dir = tmp_path_factory.mktemp("colocated") / "run"
    # one thread, as each of the 2 processes of an async job has (--nproc splits the cores): float sums in the
    # same order
    _run(_command(task, run_dir, 1, "parallel.tensor=1", "trainer.total_steps=3"), OMP_NUM_THREADS="1")
    return run_dir


K1_STEPS = 9
"""Long enough for two stops in one run with steps left after each (the signal test's second stop comes at step 5
at the latest, and a stop takes a step or two to land on a loaded machine)."""
K1 = [*ASYNC, "rollout.max_staleness=1", "algorithm.rollout_is=tis", f"trainer.total_steps={K1_STEPS}",
      "trainer.save_every=2"]


@pytest.fixture(scope="module")
def uninterrupted_k1(task, tmp_path_factory):
    """A 9-step async run at staleness 1, a checkpoint every 2 steps, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("k1") / "run"
    _run(_command(task, run_dir, 2, *K1))
    return run_dir


@pytest.mark.slow
def test_staleness_0_on_separate_ranks_trains_what_the_colocated_run_trains(task, colocated_run, tmp_path):
    """Same seed, same steps: the rollout world (hf engine) samples exactly what the colocated engine samples, so
    every batch, reward, loss, gradient norm and evaluation is equal (not within a tolerance: equal)."""
    colocated, separate = colocated_run, tmp_path / "async"
    _run(_command(task, separate, 2, *ASYNC, "rollout.max_staleness=0", "trainer.total_steps=3"))
    expected, got = read_metrics(colocated / "metrics.jsonl"), read_metrics(separate / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2, 3] and "eval/accuracy" in got[0] and "eval/accuracy" in got[2]
    assert all(row["actor/grad_norm"] > 0 for row in got[1:])  # every step moved the weights
    assert [_comparable(r) for r in got] == [_comparable(r) for r in expected]
    for row in got[1:]:
        assert row["async/weights_version"] == row["step"] - 1 and row["async/staleness_max"] == 0
        assert row["perf/sync_bytes"] > 0 and row["async/generation_tokens_per_s"] > 0
    for step in (1, 2, 3):
        assert _trained(separate, step) == _trained(colocated, step)


@pytest.mark.slow
def test_staleness_1_killed_mid_run_resumes_exactly_with_the_batch_in_flight(task, uninterrupted_k1, tmp_path):
    """k = 1, a checkpoint every 2 steps; the job is SIGKILLed once step 5 is logged (the checkpoint after step 4
    holds the batch of step 5, generated from version 3, which no checkpoint keeps). The resumed run's steps equal
    an uninterrupted run's, and every step trained the same prompts and completions: none lost, none twice."""
    settings, whole, killed = K1, uninterrupted_k1, tmp_path / "killed"
    job = subprocess.Popen(_command(task, killed, 2, *settings), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env=without_offer(_environment()), start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(r["step"] == 5 for r in _rows(killed)):
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()[-3000:] if job.stderr else ""
        time.sleep(0.05)
    _kill_whole_job(job, killed)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step_000004"
    resumed = _run(_command(task, killed, 2, *settings))
    assert "resumed from" in resumed.stderr
    expected, got = read_metrics(whole / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(K1_STEPS + 1))
    assert [_comparable(r) for r in got] == [_comparable(r) for r in expected]
    assert [r["async/weights_version"] for r in got[1:]] == [0, *range(K1_STEPS - 1)]  # the fixed lag, also after resume
    assert [r["async/staleness_max"] for r in got[1:]] == [0] + [1] * (K1_STEPS - 1)
    for step in range(1, K1_STEPS + 1):
        assert _trained(killed, step) == _trained(whole, step)


def _started_until_step(command, run_dir, step):
    """The job of ``command``, started and left running once its step ``step`` is logged (its ranks forked from the
    suite's shared fork server, which rank_pid is told: no server of the job's own to start and preload)."""
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=_environment())
    while not any(r["step"] == step for r in _rows(run_dir)):
        assert job.poll() is None, job.stderr.read()[-3000:]
        time.sleep(0.05)
    return job


def _resumed_run_equals(command, stopped, whole, saved):
    """A run stopped after step ``saved`` (its checkpoint the latest), resumed by the same ``command``: every metrics
    row and every step's trained batch equal the uninterrupted run ``whole``'s."""
    assert 1 <= saved < K1_STEPS and (stopped / "checkpoints" / "latest").read_text().strip() == f"step_{saved:06d}"
    _run(command)
    expected, got = read_metrics(whole / "metrics.jsonl"), read_metrics(stopped / "metrics.jsonl")
    assert [_comparable(r) for r in got] == [_comparable(r) for r in expected]
    for step in range(1, K1_STEPS + 1):
        assert _trained(stopped, step) == _trained(whole, step)


@pytest.mark.slow
def test_staleness_1_stopped_by_sigterm_then_by_sigusr1_on_the_rollout_rank_alone_resumes_exactly(task,
                                                                                                 uninterrupted_k1,
                                                                                                 tmp_path):
    """Two preemptions of one run, each resumed by the same command, which then equals an uninterrupted run.

    SIGTERM to the job (as SLURM's preemption sends it) once step 1 is logged: the trainer saves the step in flight
    with the batch the rollout rank already made for the next step, ends the rollout rank (whose own copy of the
    signal only says the same) and stops, and the job ends with them (not when torchrun's agent kills a rank 30 s
    later). Then, once the resumed run has logged a step of its own, SIGUSR1 to the rollout rank only (a preemption
    notice on the rollout node alone): the rollout world passes it on with its next batch, the trainer saves and
    stops the job as if it had the signal itself (before, the rollout rank recorded the signal and the run went on to
    its end). One run meets both, so the second stop also starts from a resume."""
    sys.path.insert(0, str(TESTS.parent / "bench"))
    from faults import rank_pid  # bench/faults.py: a rank's pid, forked or an interpreter

    settings, whole, stopped = K1, uninterrupted_k1, tmp_path / "stopped"
    command = _command(task, stopped, 2, *settings)
    job = _started_until_step(command, stopped, 1)
    job.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _, stderr = job.communicate(timeout=120)
    # torchrun, signalled itself, exits non-zero whatever its ranks did; the trainer's own line says it saved
    assert job.returncode != 0 and "stopped after step" in stderr, stderr[-3000:]
    # and it ends once its ranks have: the rollout rank exits as the trainer does (status 3), where a status 0 left it
    # waiting for torchrun's shutting-down agent to read it, which SIGKILLed it 30 s after the signal
    assert time.monotonic() - signalled < 25, stderr[-3000:]
    first_stop = int(re.search(r"grpo-mega train: stopped after step (\d+)", stderr).group(1))
    assert 1 <= first_stop < 4 and (stopped / "checkpoints" / "latest").read_text().strip() == \
        f"step_{first_stop:06d}", stderr[-3000:]

    job = _started_until_step(command, stopped, first_stop + 1)
    rollout_rank = rank_pid(1, stopped, program=b"grpo_mega.cli", shared_server=offered_server_pid())
    assert rollout_rank is not None
    os.kill(rollout_rank, signal.SIGUSR1)
    _, stderr = job.communicate(timeout=120)
    assert "resumed from" in stderr, stderr[-3000:]
    found = re.search(r"grpo-mega train: stopped after step (\d+) \(SIGUSR1 received\)", stderr)
    assert found and job.returncode == 3, stderr[-3000:]  # EXIT_STOPPED_EARLY, passed on by grpo-mega's launcher
    second_stop = int(found.group(1))
    assert second_stop > first_stop, stderr[-3000:]
    _resumed_run_equals(command, stopped, whole, second_stop)


def _kill_whole_job(job, run_dir):
    """SIGKILL a job as SLURM does, every process of it: the launcher's group, and the ranks, which torchrun starts
    in process groups of their own (they would otherwise go on to the next save before they notice, on a loaded
    machine: the resumed run then found the run complete); returns once none is left."""
    # torchrun's ranks: its descendants (forked from its server on a CPU build of torch: grpo_mega.run.forked_ranks)
    # or processes with the run folder in their command line (started as interpreters)
    descendants = {child.pid for child in psutil.Process(job.pid).children(recursive=True)}
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 60
    while True:
        ranks = [pid for pid in descendants if alive(pid)]
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(run_dir) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    ranks.append(int(entry.name))
            except OSError:
                continue
        if not ranks:
            return
        assert time.monotonic() < deadline, f"processes of {run_dir} outlived SIGKILL: {ranks}"
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def reward_failing_from_step_2(prompt: str, completion: str, answer: str, **extra) -> float:
    """digit_reward until the rollout world scores the batch of step 2, then an error (reward.on_error=raise)."""
    from grpo_mega.run.failure import POSITION

    if POSITION["step"] == 2:
        raise RuntimeError("the verifier broke")
    return digit_reward(prompt, completion, answer)


@pytest.mark.slow
def test_a_failure_on_the_rollout_rank_ends_the_job_naming_that_rank_and_phase(task, tmp_path):
    """The rollout world dies scoring step 2: the job ends (the trainer, waiting for the batch, sees its peer
    gone) and failure.json names the root cause, not the trainer's consequence: the rollout rank (global rank 1),
    its phase and step, the error."""
    run_dir = tmp_path / "run"
    command = _command(task, run_dir, 2, *ASYNC, "rollout.max_staleness=0", "trainer.total_steps=4",
                       f"reward.function={__name__}:reward_failing_from_step_2", "reward.on_error=raise")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_environment())
    assert result.returncode != 0
    failure = json.loads((run_dir / "failure.json").read_text())
    assert (failure["rank"], failure["step"], failure["cause"]) == (1, 2, "error"), failure
    assert failure["phase"] == "reward scoring" and "the verifier broke" in failure["exception"], failure
    assert "rank 1 on" in result.stderr and "(cause=error) at step 2 (reward scoring)" in result.stderr


@pytest.mark.slow
def test_two_rollout_ranks_both_get_every_version(task, tmp_path):
    """1 training rank, 2 rollout ranks (hf engine, a replica each): rank 0 of the rollout world relays each
    version to rank 1. At staleness 0 the batch's log-probs, half from each replica, equal the trainer's: both
    replicas generated with the trainer's current weights at every step."""
    run_dir = tmp_path / "run"
    _run(_command(task, run_dir, 3, *ASYNC, "rollout.async_ranks=2", "rollout.max_staleness=0",
                  "trainer.total_steps=3", "data.eval_file=null"))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["actor/grad_norm"] > 0 and row["rollout/logprob_diff_max"] < 1e-4, row


@pytest.mark.slow
def test_resuming_a_colocated_run_in_async_mode_is_refused_naming_the_checkpoint(task, colocated_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(colocated_run, run_dir)
    result = subprocess.run(_command(task, run_dir, 2, *ASYNC, "rollout.max_staleness=0", "trainer.total_steps=4",
                                     "data.eval_file=null"), capture_output=True, text=True, timeout=300,
                            env=_environment())
    assert result.returncode != 0
    assert "step_000003 holds no 'rollout_feed' state" in result.stderr and "model.init_from=" in result.stderr
    assert not (run_dir / "checkpoints" / "step_000004").exists()
