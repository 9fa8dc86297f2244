"""Faults end a job fast with the cause named once (issue 37): ``trainer.collective_timeout_s``, the phase watchdog,
``run_dir/failure.json``, a full disk during a save, and no process outliving its rank.

Before: a 2-rank GRPO run whose rank 1 was stopped (SIGSTOP) was still running 180 s later, saying nothing (every
collective waited torch's 30 minutes). Now every collective is bounded by ``trainer.collective_timeout_s``: the
rank waiting for the stopped one raises, writes ``failure.json`` (step, phase, rank, host, cause, exception) and
torchrun ends the job; the stopped rank, which cannot act on torchrun's SIGTERM (torchrun would wait 30 s), is
killed by its watcher (``grpo_mega.run.reaper``) as soon as the SIGTERM is pending: the job ends within 2 x the
timeout. The SLURM requeue policy on these causes is tested in test_slurm_faults.py and test_slurm.py; the fault
bench (bench/faults.py) injects every fault at random moments."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.run.failure import POSITION, classify, failure_line, note_signal, phase, record_failure, set_step
from grpo_mega.run.metrics import read_metrics
from grpo_mega.run.procfs import alive
from grpo_mega.run.shared_fork_server import offered_server_pid
from tiny_task import build_tiny_task, tiny_run_overrides

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from faults import rank_pid  # noqa: E402  (bench/faults.py)
TIMEOUT_S = 15
STOPPED_TIMEOUT_S = 10
"""trainer.collective_timeout_s of the stopped-rank test, which waits it out (15 s before: 15 of the test's 37 s in
CI); still several times a tiny step, the longest honest wait of one rank for the other there. Measured at load
average 8: the job ended 13.7 s after the SIGSTOP at 8 s, 22.9 s at 15 s."""


@pytest.fixture(autouse=True)
def no_signal_received(monkeypatch):
    """Classification reads whether this process received a stop signal: none, unless a test says so."""
    monkeypatch.setitem(POSITION, "signal", None)


def test_failures_are_classified_so_a_requeue_policy_can_tell_transient_from_deterministic():
    class NonFiniteError(Exception):
        pass

    class ConfigError(Exception):
        pass

    gloo_timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation")
    assert classify(gloo_timeout) == "collective_timeout"
    assert classify(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")) \
        == "peer_lost"
    assert classify(NonFiniteError("loss is nan")) == "non_finite" and classify(ConfigError("bad key")) == "config"
    assert classify(ValueError("timed out reading the data file")) == "error"  # not a collective


def test_the_first_rank_to_fail_writes_failure_json_and_the_others_only_print(tmp_path, monkeypatch):
    monkeypatch.setattr("grpo_mega.run.failure.DEFER_S", 0.0)
    set_step(7)
    monkeypatch.setenv("RANK", "1")
    with phase("update"):
        first, path = record_failure(tmp_path, RuntimeError("gloo: Timed out waiting 15000ms"))
    assert path == tmp_path / "failure.json"
    assert {k: first[k] for k in ("step", "phase", "rank", "cause")} == {"step": 7, "phase": "update", "rank": 1,
                                                                         "cause": "collective_timeout"}
    monkeypatch.setenv("RANK", "0")
    second, second_path = record_failure(tmp_path, RuntimeError("gloo: Connection closed by peer"))
    assert second_path is None and json.loads(path.read_text())["rank"] == 1  # kept: the first cause
    line = failure_line("grpo-mega train", second, None)
    assert line.startswith("grpo-mega train: rank 0 on ") and "failed (cause=peer_lost) at step 7 (start-up): " in line
    set_step(None)



def test_a_rank_that_lost_its_peer_lets_the_root_cause_claim_failure_json(tmp_path, monkeypatch):
    """The rank that waited for (or lost) a failing peer usually fails at the same moment as the peer; it defers, so
    failure.json names the peer's own cause."""
    import threading

    monkeypatch.setattr("grpo_mega.run.failure.DEFER_S", 1.0)
    waiting = threading.Thread(target=record_failure, args=(tmp_path, RuntimeError("gloo: Timed out waiting 20000ms")))
    waiting.start()
    time.sleep(0.2)  # the waiting rank failed first, by a little
    _, path = record_failure(tmp_path, ValueError("the peer's own error"))
    waiting.join()
    assert path is not None and json.loads(path.read_text())["cause"] == "error"

def test_nccl_ends_the_process_on_a_timeout_unless_the_user_says_otherwise():
    from grpo_mega.parallel.launch_env import nccl_fault_environment

    assert nccl_fault_environment({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl_fault_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) == {}


def test_a_timeout_that_is_not_positive_is_a_config_error():
    from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate

    with pytest.raises(ConfigError, match="trainer.collective_timeout_s=0.0 must be > 0"):
        load_config(GRPOConfig, REPO / "configs/quickstart_grpo.yaml",
                    ["model.hf_config=x", "data.train_file=y", "trainer.collective_timeout_s=0"], validate)


def _rank_pid(rank: int, run_dir: Path) -> int | None:
    """The pid of the trainer process of ``rank`` in the job writing to ``run_dir`` (not torchrun itself), forked
    from the suite's shared fork server where it offers one."""
    return rank_pid(rank, run_dir, b"grpo_mega.cli", shared_server=offered_server_pid())


def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_the_cause(tmp_path):
    task = build_tiny_task(tmp_path / "task")
    run_dir = tmp_path / "grpo"
    command = [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(REPO / "configs/quickstart_grpo.yaml"),
               "--nproc", "2", *tiny_run_overrides(task, run_dir, "trainer.total_steps=100",
                                                   f"trainer.collective_timeout_s={STOPPED_TIMEOUT_S}")]
    # the ranks forked from the suite's shared fork server (no server of the job's own to start and preload)
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    stopped = None
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert job.poll() is None and time.monotonic() < deadline, "the run never logged its first step"
            time.sleep(0.2)
        stopped = _rank_pid(1, run_dir)
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)  # a hang: the process lives, holds its sockets, and answers nothing
        start = time.monotonic()
        output, _ = job.communicate(timeout=STOPPED_TIMEOUT_S + 90)
        elapsed = time.monotonic() - start
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert elapsed < 2 * STOPPED_TIMEOUT_S, f"the job took {elapsed:.0f} s to end"
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["rank"] == 0 and failure["cause"] == "collective_timeout" and failure["step"] >= 2
    assert f"Timed out waiting {STOPPED_TIMEOUT_S * 1000}ms" in failure["exception"]
    assert "grpo-mega train: rank 0" in output and "failed (cause=collective_timeout)" in output


def test_causes_a_requeue_policy_acts_on():
    from grpo_mega.data.prompts import BadRowError
    from grpo_mega.run.failure import TRANSIENT_CAUSES, PhaseTimeout

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("Worker failure")
    wrapped.__cause__ = full
    assert classify(full) == "disk_full" and classify(wrapped) == "disk_full"  # found down the chain
    assert classify(BadRowError("train.jsonl:3: not JSON")) == "data"
    assert classify(RuntimeError("CUDA error: uncorrectable ECC error encountered")) == "hardware"
    assert classify(PhaseTimeout("phase 'save' ran past 5 s")) == "phase_timeout"
    assert set(TRANSIENT_CAUSES) == {"collective_timeout", "peer_lost", "phase_timeout", "hardware", "terminated"}
    helper_lost = BrokenPipeError(32, "Broken pipe")  # megatron's checkpoint writer talks to a killed process
    assert classify(helper_lost) == "peer_lost"
    teardown = RuntimeError("something else failed")
    assert classify(teardown) == "error"
    note_signal("SIGTERM")  # torchrun tears every rank down once one has died
    try:
        assert classify(teardown) == "terminated" and classify(BadRowError("x.jsonl:2: bad")) == "data"
    finally:
        POSITION["signal"] = None


def test_an_error_keeps_the_phase_it_left(tmp_path):
    set_step(3)
    try:
        with phase("update"), phase("save"):
            raise RuntimeError("boom")
    except RuntimeError as error:
        record, _ = record_failure(tmp_path, error)
    set_step(None)
    assert (record["step"], record["phase"]) == (3, "save")  # not the phase the rank is in once it is caught


WATCHED = """
import sys, time
from grpo_mega.run.failure import phase, set_step
from grpo_mega.run.watchdog import PhaseWatchdog
watchdog = PhaseWatchdog(sys.argv[1], 1.5, command="grpo-mega train", setting="trainer.collective_timeout_s=1.5 s")
watchdog.install()
set_step(4)
with phase("sync", bounded=True):
    time.sleep(0.5)                      # done in time: disarmed
time.sleep(2.5)                          # unbounded: never fires
with phase("sync", bounded=True), phase("vllm wake (weights)", bounded=True, alone=True):
    time.sleep(60)                       # a wake-up that never returns
print("not reached")
"""


def test_a_bounded_phase_that_hangs_ends_the_process_naming_the_phase(tmp_path):
    from grpo_mega.run.watchdog import EXIT_PHASE_TIMEOUT

    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path)], capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    elapsed = time.monotonic() - start
    assert result.returncode == EXIT_PHASE_TIMEOUT and "not reached" not in result.stdout
    assert 4.5 < elapsed < 20, elapsed  # 0.5 + 2.5 s of work, then the 1.5 s deadline (+ start-up)
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert (failure["cause"], failure["phase"], failure["step"]) == ("phase_timeout", "vllm wake (weights)", 4)
    assert "grpo-mega train: rank 0 on " in result.stderr and "failed (cause=phase_timeout) at step 4" in result.stderr
    hung_line = next(n for n, line in enumerate(WATCHED.splitlines(), 1) if "time.sleep(60)" in line)
    assert f'File "<string>", line {hung_line} in <module>' in result.stderr  # every thread's stack: where it hung


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_during_a_save_names_the_path_and_keeps_the_previous_checkpoint(tmp_path):
    """The tiny run's checkpoint is ~13 MB: a 20 MB file system takes the first save and fills in the second."""
    from grpo_mega.checkpoint.training_files import checkpoint_problem

    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "20m"):
        pytest.skip("mounting a size-limited tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        task = build_tiny_task(tmp_path / "task")
        run_dir = disk / "run"
        common = [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(REPO / "configs/quickstart_grpo.yaml"),
                  "--nproc", "2"]
        settings = ["trainer.save_every=1", "trainer.eval_every=0", f"trainer.collective_timeout_s={TIMEOUT_S}"]
        result = subprocess.run([*common, *tiny_run_overrides(task, run_dir, "trainer.total_steps=3", *settings)],
                                capture_output=True, text=True, cwd=REPO, timeout=300)
        assert result.returncode != 0
        failure = json.loads((run_dir / "failure.json").read_text())
        staging = run_dir / "checkpoints" / ".tmp-step_000002"
        assert (failure["cause"], failure["phase"], failure["step"]) == ("disk_full", "save", 2)
        assert f"no space left on the file system of {staging}" in failure["exception"]
        assert f"the previous checkpoint {run_dir / 'checkpoints' / 'step_000001'} is untouched" in failure["exception"]
        assert "failed (cause=disk_full) at step 2 (save)" in result.stderr
        assert not staging.exists()  # the partial save gave its space back
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
        assert checkpoint_problem(run_dir / "checkpoints" / "step_000001") is None
        moved = tmp_path / "run"  # room again: the run resumes from step 1 and finishes
        shutil.copytree(run_dir, moved)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    result = subprocess.run([*common, *tiny_run_overrides(task, moved, "trainer.total_steps=3", *settings)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "step_000001 at step 1" in result.stderr
    assert [row["step"] for row in read_metrics(moved / "metrics.jsonl")] == [1, 2, 3]


REAPED = """
import os, sys, time
from grpo_mega.run.reaper import reap_group_when_rank_exits
assert reap_group_when_rank_exits() is not None
helper = os.fork()                       # as megatron's checkpoint writer forks from the rank
if helper == 0:
    time.sleep(300)
    os._exit(0)
print(helper, flush=True)
time.sleep(300)
"""


def test_a_killed_ranks_helpers_do_not_outlive_it():
    """torchrun signals only the groups of ranks still alive: a SIGKILLed rank's helpers used to live on (and, under
    SLURM, hold the step's output open so the job never ended). The rank's watcher kills them."""
    from grpo_mega.run.reaper import reap_group_when_rank_exits

    assert reap_group_when_rank_exits(environ={}) is None  # not a torchrun rank: nothing to do
    rank = subprocess.Popen([sys.executable, "-c", REAPED], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, TORCHELASTIC_RUN_ID="test"), start_new_session=True)
    try:
        helper = int(rank.stdout.readline())
        assert alive(helper)
        rank.kill()
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(helper), "the helper outlived its rank"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)


def test_a_stopped_rank_told_to_end_is_killed_at_once():
    """torchrun gives a rank 30 s between SIGTERM and SIGKILL when another rank failed; a stopped rank cannot act on
    the SIGTERM, so its watcher kills it as soon as one is pending."""
    rank = subprocess.Popen([sys.executable, "-c", REAPED], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, TORCHELASTIC_RUN_ID="test"), start_new_session=True)
    try:
        helper = int(rank.stdout.readline())
        os.kill(rank.pid, signal.SIGSTOP)
        time.sleep(1.5)
        assert rank.poll() is None and alive(helper)  # stopped, not told to end: left alone (a debugger, ^Z)
        start = time.monotonic()
        os.kill(rank.pid, signal.SIGTERM)
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert time.monotonic() - start < 3
        deadline = time.monotonic() + 5
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(helper)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)


SHARES_MEMORY = """
import sys, time
from multiprocessing import shared_memory
from grpo_mega.run.reaper import reap_group_when_rank_exits
assert reap_group_when_rank_exits() is not None
queue = shared_memory.SharedMemory(create=True, size=1 << 20)   # as vLLM's message queue: the tracker knows it
print(queue.name, flush=True)
time.sleep(300)
"""


def test_shared_memory_of_a_killed_rank_is_unlinked():
    """The watcher spares the rank's resource tracker, which unlinks what the dead rank left in /dev/shm."""
    rank = subprocess.Popen([sys.executable, "-c", SHARES_MEMORY], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, TORCHELASTIC_RUN_ID="test"), start_new_session=True)
    try:
        segment = Path("/dev/shm") / rank.stdout.readline().strip()
        assert segment.exists()
        rank.kill()
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while segment.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not segment.exists(), f"{segment} outlived its rank"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)
