"""launch/slurm/train.sbatch across two SLURM nodes: two slurmd in two network namespaces joined by a private veth
link (slurm_two_nodes.py), one torchrun per node, the c10d rendezvous and gloo across the link. One job is told to
stop (USR1 to the batch shell, as --signal=B:USR1@300 does before the time limit): both ranks save the same step,
the job requeues itself and resumes on both nodes from that checkpoint; then it loses each node in turn (issue 37),
requeues itself as for a transient fault and resumes each time, and completes, with every step logged once.
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
TOTAL_STEPS = 20
"""The job's steps: a stop on USR1 sent after step 1 (several steps later on a loaded machine: the step in flight
when the signal arrives), then a node loss after each resumed run's first checkpoint (at most 2 steps in) leave steps
to run after each."""


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


def _submit(cluster, task, run_dir: Path, log_dir: Path, *extra: str) -> tuple[str, Path]:
    """train.sbatch on both nodes, one rank each (world 2, data parallel across the link), ``TOTAL_STEPS`` steps of
    the tiny task with ``extra`` overrides; returns (job id, its log)."""
    overrides = tiny_run_overrides(task, run_dir, "parallel.tensor=1", f"trainer.total_steps={TOTAL_STEPS}", *extra)
    env = cluster.env(CONFIG=str(CONFIG), NPROC_PER_NODE="1", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    submit = cluster.run("sbatch", "--parsable", "--nodes=2", *cpu_node_options(), f"--output={log_dir}/%x-%j.out",
                         str(TRAIN_SBATCH), *overrides, env=env)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    return job_id, log_dir / f"grpo-mega-{job_id}.out"


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
def test_a_two_node_job_stops_on_usr1_then_survives_the_loss_of_either_node(cluster, task, tmp_path):
    """One job's life on two nodes, one rank per node (world 2, data parallel across the link), a checkpoint every 2
    steps: told to stop (USR1), it saves, requeues itself and resumes; then node loss (issue 37), of each node in
    turn, once the resumed run has saved a checkpoint of its own: every process of the job's step on one node is
    SIGKILLed, as a node crash does: the second node, then the first, which hosts the rendezvous and the store the
    ranks meet at (issue 51: the surviving launcher then fails in its rendezvous, a rank at its store). Whichever
    process sees the loss first, it is named a transient cause, the job requeues itself (the SLURM scripts' policy,
    launch/slurm/common.sh; the USR1 requeue is no fault and is not counted), resumes on both nodes from the last
    complete checkpoint and, after the second loss, completes, every step logged once. (One job for all three: a job
    each would repeat the first run's start-up, the rendezvous across the link, twice more.)"""
    run_dir, lost = tmp_path / "run", (NODES[1], NODES[0])
    job_id, log = _submit(cluster, task, run_dir, tmp_path, "trainer.save_every=2", "trainer.collective_timeout_s=20")
    seconds_to_requeue = []
    try:
        _wait_for(lambda: _logged_steps(run_dir), 240, "step 1 in metrics.jsonl", log)
        assert cluster.run("scancel", "--signal=USR1", "--batch", job_id).returncode == 0
        _wait_for(lambda: "stopped early with a checkpoint; requeueing" in log.read_text(), 120,
                  "the batch script to requeue the job", log)
        for restart, node in enumerate(lost, start=1):
            # the resumed run has saved a checkpoint of its own (the line comes once it is complete)
            _wait_for(lambda r=restart: "saved checkpoint" in log.read_text().partition(f"SLURM_RESTART_COUNT={r}")[2],
                      240, f"a checkpoint saved by restart {restart}", log)
            seconds_to_requeue.append(_lose_node(job_id, node, log, requeues=restart))
        _wait_for(lambda: "SLURM_RESTART_COUNT=3" in log.read_text(), 240, "the job to restart", log)
        running = {None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"}
        state = _wait_for(lambda: (s := _job(cluster, job_id).get("JobState")) not in running and s, 300,
                          f"job {job_id} to finish", log)
    finally:
        cluster.run("scancel", job_id)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    runs = re.split(r"SLURM_RESTART_COUNT=[123] ", text)
    assert len(runs) == 4, text[-4000:]
    # Every run on both nodes; the rank-0 node hosts the rendezvous, which the other node reaches over the link.
    for part in runs:
        assert re.search(r"nodes=gmnode\[1-2\]", part), part[:500]
    # The stop: both ranks after the same step, agreed through an all-reduce across the link. One rank per node: two
    # ranks means both torchruns joined the rendezvous (--nnodes=2 waits for both).
    first = runs[0]
    stopped = [int(n) for n in re.findall(r"grpo-mega train: stopped after step (\d+)", first)]
    assert len(stopped) == 2 and stopped[0] == stopped[1] and 1 <= stopped[0] < TOTAL_STEPS, first[-4000:]
    assert "USR1 received" in first and "requeueing" in first
    assert re.search(rf"resumed from \S*step_{stopped[0]:06d} at step {stopped[0]}", runs[1]), runs[1][-4000:]
    assert "stopped after step" not in "".join(runs[1:])
    # The losses: each a transient fault, named in one line per cause, requeued in time, resumed past the last resume.
    resumed_from = stopped[0]
    for requeues, (node, before, after) in enumerate(zip(lost, runs[1:3], runs[2:4]), start=1):
        assert re.search(rf"transient fault \(cause=[a-z_: ]+.*\), fault requeue {requeues} of 3; requeueing",
                         before), before[-3000:]
        named = re.findall(r"failed \(cause=([a-z_]+)\)", before)
        assert not set(named) - {"collective_timeout", "peer_lost", "terminated"}, before[-3000:]
        assert "Traceback" not in before and "ChildFailedError" not in before, before[-3000:]
        seconds = seconds_to_requeue[requeues - 1]
        assert seconds < 2 * 20 + 30, seconds  # 2 x the timeout, + torchrun's grace
        resumed = re.search(r"resumed from \S*step_(\d+) at step (\d+)", after)
        assert resumed, after[-3000:]
        step = int(resumed.group(1))
        # a complete (periodic) checkpoint, past the step the lost run had resumed from
        assert step % 2 == 0 and resumed_from < step < TOTAL_STEPS, after[-3000:]
        resumed_from = step
        print(f"node loss ({node}): requeued {seconds:.1f} s after the kill; named {sorted(set(named))}; "
              f"resumed from step {step}")
    # Every step logged exactly once across the four runs, and the final checkpoint written.
    assert _logged_steps(run_dir) == list(range(1, TOTAL_STEPS + 1))
    complete = run_dir / "checkpoints" / f"step_{TOTAL_STEPS:06d}" / "complete.json"
    assert json.loads(complete.read_text())["step"] == TOTAL_STEPS
