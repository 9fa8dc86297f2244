"""launch/slurm/*.sbatch on a real one-node SLURM cluster (installed with apt when missing, see slurm_cluster.py):
a 2-step training job completes, and a job told to stop (USR1 to the batch shell, as --signal=B:USR1@300 does
before the time limit) saves, requeues itself and resumes from the saved step."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.metrics import read_metrics
from tiny_task import build_tiny_task, tiny_run_overrides

from slurm_cluster import slurm_cluster

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
TRAIN_SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
CONVERT_SBATCH = REPO / "launch" / "slurm" / "convert.sbatch"


@pytest.mark.parametrize("script", [TRAIN_SBATCH, CONVERT_SBATCH], ids=lambda p: p.name)
def test_sbatch_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node" in text


def test_train_sbatch_computes_the_rendezvous_host_inside_the_step():
    text = TRAIN_SBATCH.read_text()
    assert re.search(r"srun [^\n]*bash -c '\n\s*head=\$\(scontrol show hostnames", text)
    for option in ("--signal=B:USR1@300", "--requeue", "--open-mode=append", "--rdzv-id=\"$SLURM_JOB_ID\""):
        assert option in text


@pytest.fixture(scope="module")
def cluster():
    yield from slurm_cluster()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _overrides(task, run_dir, *extra):
    return tiny_run_overrides(task, run_dir, "trainer.save_every=0", *extra)


def _submit(log_dir: Path, *args) -> str:
    env = dict(os.environ, CONFIG=str(CONFIG), NPROC_PER_NODE="2", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    result = subprocess.run(["sbatch", "--parsable", f"--output={log_dir}/%x-%j.out", str(TRAIN_SBATCH), *args],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _final_state(job_id: str, log: Path) -> str:
    """The job's state once it has left the pending / running states (waits up to 240 s)."""
    running = {None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}
    return _wait_for(lambda: (s := _job(job_id).get("JobState")) not in running and s, 240, f"job {job_id} to finish",
                     log)


def _wait_for(predicate, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    text = log.read_text()[-4000:] if log.exists() else "(no log)"
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; log:\n{text}")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [row["step"] for row in read_metrics(path)] if path.exists() and path.read_text().strip() else []


@pytest.mark.slow
def test_train_sbatch_runs_two_steps_on_one_node(cluster, task, tmp_path):
    run_dir = tmp_path / "run"
    job_id = _submit(tmp_path, *_overrides(task, run_dir, "trainer.total_steps=2"))
    log = tmp_path / f"grpo-mega-{job_id}.out"
    try:
        state = _final_state(job_id, log)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "SLURM_RESTART_COUNT=0" in text
    assert _steps(run_dir) == [1, 2]


@pytest.mark.slow
def test_usr1_to_the_batch_shell_saves_requeues_and_resumes(cluster, task, tmp_path):
    run_dir = tmp_path / "run"
    job_id = _submit(tmp_path, *_overrides(task, run_dir, "trainer.total_steps=40"))
    log = tmp_path / f"grpo-mega-{job_id}.out"
    try:
        _wait_for(lambda: _steps(run_dir), 240, "step 1 in metrics.jsonl", log)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        _wait_for(lambda: "requeueing" in log.read_text(), 120, "the batch script to requeue the job", log)

        # A requeued job starts again only after the job credential lifetime (120 s by default; the test cluster
        # sets AuthInfo=cred_expire=10): starting it earlier fails with "Job credential revoked".
        _wait_for(lambda: "SLURM_RESTART_COUNT=1" in log.read_text(), 240, "the job to be requeued and restart",
                  log)
        _wait_for(lambda: re.search(r"resumed from \S*step_\d+", log.read_text()), 240, "the resumed run", log)
        text = log.read_text()
        stopped = [int(n) for n in re.findall(r"grpo-mega train: stopped after step (\d+)", text)]
        assert stopped and 1 <= stopped[0] < 40, text[-4000:]
        assert re.search(rf"resumed from \S*step_{stopped[0]:06d}", text), text[-4000:]
        assert "USR1 received" in text and "requeueing" in text
        _wait_for(lambda: len(_steps(run_dir)) > stopped[0], 240, "a step after the resume", log)
        assert _steps(run_dir)[: stopped[0] + 1] == list(range(1, stopped[0] + 2))
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        _wait_for(lambda: _job(job_id).get("JobState") in {None, "CANCELLED", "COMPLETED", "FAILED"}, 120,
                  f"job {job_id} to end", log)


@pytest.mark.slow
def test_convert_sbatch_runs_one_task_per_tensor_parallel_rank(cluster, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    hf, out = tmp_path / "hf", tmp_path / "ckpt"
    config = Qwen2Config(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    env = dict(os.environ, HF=str(hf), OUT=str(out), TP="2", PP="1", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    result = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", f"--output={tmp_path}/%x-%j.out",
                             str(CONVERT_SBATCH)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    log = tmp_path / f"grpo-mega-convert-{job_id}.out"
    try:
        state = _final_state(job_id, log)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", log.read_text()[-4000:]
    assert json.loads((out / "grpo_mega_model.json").read_text())["saved_tensor_parallel"] == 2
