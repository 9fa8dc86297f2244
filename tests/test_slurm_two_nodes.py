"""launch/slurm/train.sbatch across two SLURM nodes: two slurmd in two network namespaces joined by a private veth
link (slurm_two_nodes.py), one torchrun per node, the c10d rendezvous and gloo across the link. One job is told to
stop (USR1 to the batch shell, as --signal=B:USR1@300 does before the time limit): both ranks save the same step,
the job requeues itself, resumes on both nodes from that checkpoint and completes, with every step logged once.
Multi-node is where peers' users report stalls (a rendezvous host that only one node can resolve, a step that sees
the other node's address wrong); this is the same script a user submits, with the CPU test cluster's options."""

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import cpu_node_options
from slurm_two_nodes import NODES, job_processes_on, two_node_cluster
from tiny_task import build_tiny_task, tiny_run_overrides

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
TRAIN_SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
TOTAL_STEPS = 12


@pytest.fixture(scope="module")
def cluster():
    yield from two_node_cluster()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _job(cluster, job_id: str) -> dict[str, str]:
    out = cluster.run("scontrol", "-o", "show", "job", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait_for(predicate, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    text = log.read_text()[-4000:] if log.exists() else "(no log)"
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; log:\n{text}")


def _logged_steps(run_dir: Path) -> list[int]:
    """Every step line of metrics.jsonl in order, repeats included."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _submit(cluster, task, run_dir: Path, log_dir: Path, *extra: str, steps: int = TOTAL_STEPS) -> tuple[str, Path]:
    """train.sbatch on both nodes, one rank each (world 2, data parallel across the link), ``steps`` steps of the tiny
    task with ``extra`` overrides; returns (job id, its log)."""
    overrides = tiny_run_overrides(task, run_dir, "parallel.tensor=1", f"trainer.total_steps={steps}", *extra)
    env = cluster.env(CONFIG=str(CONFIG), NPROC_PER_NODE="1", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    submit = cluster.run("sbatch", "--parsable", "--nodes=2", *cpu_node_options(), f"--output={log_dir}/%x-%j.out",
                         str(TRAIN_SBATCH), *overrides, env=env)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    return job_id, log_dir / f"grpo-mega-{job_id}.out"


def _state_after_restart(cluster, job_id: str, log: Path) -> str:
    """The job's final state, once it has restarted (a requeued job starts again after the job credential lifetime,
    AuthInfo=cred_expire=5 on the cluster) and finished."""
    _wait_for(lambda: "SLURM_RESTART_COUNT=1" in log.read_text(), 240, "the job to restart", log)
    running = {None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"}
    return _wait_for(lambda: (s := _job(cluster, job_id).get("JobState")) not in running and s, 300,
                     f"job {job_id} to finish", log)


@pytest.mark.slow
def test_two_node_job_stops_on_usr1_requeues_resumes_and_completes(cluster, task, tmp_path):
    run_dir = tmp_path / "run"
    # One rank per node (world 2, data parallel across the link); a checkpoint only when told to stop and at the end.
    job_id, log = _submit(cluster, task, run_dir, tmp_path, "trainer.save_every=0")
    try:
        _wait_for(lambda: _logged_steps(run_dir), 240, "step 1 in metrics.jsonl", log)
        assert cluster.run("scancel", "--signal=USR1", "--batch", job_id).returncode == 0
        _wait_for(lambda: "requeueing" in log.read_text(), 120, "the batch script to requeue the job", log)
        state = _state_after_restart(cluster, job_id, log)
    finally:
        cluster.run("scancel", job_id)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    first, second = text.split("SLURM_RESTART_COUNT=1")
    # Both runs on both nodes; the rank-0 node hosts the rendezvous, which the other node reaches over the link.
    for part in (first, second):
        assert re.search(r"nodes=gmnode\[1-2\]", part), part[:500]
    # The stop: both ranks after the same step, agreed through an all-reduce across the link. One rank per node: two
    # ranks means both torchruns joined the rendezvous (--nnodes=2 waits for both).
    stopped = [int(n) for n in re.findall(r"grpo-mega train: stopped after step (\d+)", first)]
    assert len(stopped) == 2 and stopped[0] == stopped[1] and 1 <= stopped[0] < TOTAL_STEPS, first[-4000:]
    assert "USR1 received" in first and "requeueing" in first
    assert re.search(rf"resumed from \S*step_{stopped[0]:06d} at step {stopped[0]}", second), second[-4000:]
    assert "stopped after step" not in second
    # Every step logged exactly once across the two runs, and the final checkpoint written.
    assert _logged_steps(run_dir) == list(range(1, TOTAL_STEPS + 1))
    complete = run_dir / "checkpoints" / f"step_{TOTAL_STEPS:06d}" / "complete.json"
    assert json.loads(complete.read_text())["step"] == TOTAL_STEPS


LOSS_STEPS = 16
"""Steps of the node-loss job: losses after step 3 of the first run and after the resumed run's first checkpoint
(2 steps in) leave steps to run after each, however far the steps in flight get before the processes are killed."""


def _lose_node(job_id: str, node: str, log: Path, requeues: int) -> float:
    """SIGKILL every process of the job's step on ``node``, as a node crash does; wait until the batch script has
    requeued the job for its ``requeues``-th transient fault; the seconds from the kill to that line."""
    victims = job_processes_on(job_id, node)
    assert victims, f"no process of the job on {node}"
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _wait_for(lambda: f"fault requeue {requeues} of 3; requeueing" in log.read_text(), 120,
              "the batch script to requeue the job", log)
    return time.monotonic() - killed


@pytest.mark.slow
def test_a_lost_node_requeues_the_job_which_resumes_on_both_nodes(cluster, task, tmp_path):
    """Node loss (issue 37), of each node in turn in one job: every process of the job's step on one node is
    SIGKILLed mid-run, as a node crash does: the second node in the first run, then the first, which hosts the
    rendezvous and the store the ranks meet at (issue 51: the surviving launcher then fails in its rendezvous, a rank
    at its store), in the resumed run. Whichever process sees the loss first, it is named a transient cause, the job
    requeues itself (the SLURM scripts' policy, launch/slurm/common.sh), resumes on both nodes from the last complete
    checkpoint and, after the second loss, completes, every step logged once. (One job for both losses: a job per
    loss would start a first run for the second loss only to repeat the first run of the first.)"""
    run_dir, lost = tmp_path / "run", (NODES[1], NODES[0])
    job_id, log = _submit(cluster, task, run_dir, tmp_path, "trainer.save_every=2", "trainer.collective_timeout_s=20",
                          steps=LOSS_STEPS)
    seconds_to_requeue = []
    try:
        _wait_for(lambda: len(_logged_steps(run_dir)) >= 3, 240, "step 3 in metrics.jsonl", log)
        seconds_to_requeue.append(_lose_node(job_id, lost[0], log, requeues=1))
        # the resumed run has saved a checkpoint of its own (the line comes once it is complete)
        _wait_for(lambda: "saved checkpoint" in log.read_text().partition("SLURM_RESTART_COUNT=1")[2], 240,
                  "a checkpoint saved by the resumed run", log)
        seconds_to_requeue.append(_lose_node(job_id, lost[1], log, requeues=2))
        _wait_for(lambda: "SLURM_RESTART_COUNT=2" in log.read_text(), 240, "the job to restart", log)
        running = {None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"}
        state = _wait_for(lambda: (s := _job(cluster, job_id).get("JobState")) not in running and s, 300,
                          f"job {job_id} to finish", log)
    finally:
        cluster.run("scancel", job_id)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    first, rest = text.split("SLURM_RESTART_COUNT=1")
    second, third = rest.split("SLURM_RESTART_COUNT=2")
    resumed_from = 0
    for requeues, (node, before, after) in enumerate(zip(lost, (first, second), (second, third)), start=1):
        assert re.search(rf"transient fault \(cause=[a-z_: ]+.*\), fault requeue {requeues} of 3; requeueing",
                         before), before[-3000:]
        named = re.findall(r"failed \(cause=([a-z_]+)\)", before)
        assert not set(named) - {"collective_timeout", "peer_lost", "terminated"}, before[-3000:]
        assert "Traceback" not in before and "ChildFailedError" not in before, before[-3000:]  # one line per cause
        seconds = seconds_to_requeue[requeues - 1]
        assert seconds < 2 * 20 + 30, seconds  # 2 x the timeout, + torchrun's grace
        resumed = re.search(r"resumed from \S*step_(\d+) at step (\d+)", after)
        assert resumed, after[-3000:]
        step = int(resumed.group(1))
        # a complete checkpoint, past the one the run itself resumed from (the second loss came after its own save)
        assert step % 2 == 0 and resumed_from < step < LOSS_STEPS, after[-3000:]
        assert re.search(r"nodes=gmnode\[1-2\]", after)
        resumed_from = step
        print(f"node loss ({node}): requeued {seconds:.1f} s after the kill; named {sorted(set(named))}; "
              f"resumed from step {step}")
    assert _logged_steps(run_dir) == list(range(1, LOSS_STEPS + 1))
