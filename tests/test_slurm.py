"""launch/slurm/* on a real one-node SLURM cluster (installed with apt when missing, see slurm_cluster.py):
pipeline.sh chains labels + PRM training and GRPO as dependent jobs, and its PRM job, told to stop (USR1 to the batch
shell, as --signal=B:USR1@300 does before the time limit), saves, requeues itself and resumes from the saved step,
then its 2-step GRPO job (train.sbatch) completes without a restart; faults (issue 37): a rank SIGKILLed mid-run
makes the job requeue itself and resume, a corrupt data row fails it without a requeue. The same
stop-requeue-resume of a GRPO job (train.sbatch), and a lost node, run across two nodes in
test_slurm_two_nodes.py."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.run.metrics import read_metrics
from test_faults import _rank_pid
from tiny_task import build_tiny_task, tiny_run_overrides

from slurm_cluster import cpu_node_options, slurm_cluster

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
PRM_CONFIG = REPO / "configs" / "quickstart_prm.yaml"
SLURM_DIR = REPO / "launch" / "slurm"
TRAIN_SBATCH = SLURM_DIR / "train.sbatch"
PRM_SBATCH = SLURM_DIR / "prm.sbatch"
CONVERT_SBATCH = SLURM_DIR / "convert.sbatch"
PIPELINE = SLURM_DIR / "pipeline.sh"


@pytest.mark.parametrize("script", [TRAIN_SBATCH, PRM_SBATCH, CONVERT_SBATCH, PIPELINE, SLURM_DIR / "common.sh"],
                         ids=lambda p: p.name)
def test_launch_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if script.suffix == ".sbatch":
        assert "#SBATCH --ntasks-per-node" in script.read_text()


@pytest.mark.parametrize("script", [TRAIN_SBATCH, PRM_SBATCH], ids=lambda p: p.name)
def test_training_jobs_ask_for_whole_gpu_nodes(script):
    """Where GPUs are scheduled as gres, a job that does not ask for them gets none: the request is active (not a
    commented-out ##SBATCH line), with the CPUs, the memory and the node to itself."""
    lines = set(re.findall(r"^#SBATCH (--[\w-]+(?:=\S+)?)", script.read_text(), flags=re.MULTILINE))
    assert {"--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive", "--mem=0"} <= lines
    assert any(re.fullmatch(r"--cpus-per-task=\d+", line) for line in lines)
    common = (SLURM_DIR / "common.sh").read_text()
    # the torchrun step gets the job's CPUs (srun takes --cpus-per-task only from SRUN_CPUS_PER_TASK since 22.05)
    assert re.search(r"export SRUN_CPUS_PER_TASK=\$\{SRUN_CPUS_PER_TASK:-\$SLURM_CPUS_PER_TASK\}", common)
    assert "SLURM_GPUS_ON_NODE" in common


def test_the_rendezvous_host_is_computed_inside_the_step():
    common = (SLURM_DIR / "common.sh").read_text()
    assert re.search(r"srun [^\n]*bash -c '\n\s*head=\$\(scontrol show hostnames", common)
    assert '--rdzv-id="$rdzv_id"' in common and '"$SLURM_JOB_ID-$name"' in common
    for script in (TRAIN_SBATCH, PRM_SBATCH):
        text = script.read_text()
        assert "/common.sh\"" in text
        for option in ("--signal=B:USR1@300", "--requeue", "--open-mode=append"):
            assert f"#SBATCH {option}" in text


@pytest.fixture(scope="module")
def cluster():
    yield from slurm_cluster()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


def _overrides(task, run_dir, *extra):
    return tiny_run_overrides(task, run_dir, "trainer.save_every=0", *extra)


def _job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, NPROC_PER_NODE="2", PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _submit(log_dir: Path, *args) -> str:
    result = subprocess.run(["sbatch", "--parsable", *cpu_node_options(), f"--output={log_dir}/%x-%j.out",
                             str(TRAIN_SBATCH), *args],
                            cwd=REPO, env=_job_env(CONFIG=str(CONFIG)), capture_output=True, text=True, timeout=30)
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


def _run_to_the_end(log_dir: Path, *args) -> tuple[str, str, str]:
    """Submit train.sbatch with ``args`` and wait until it has ended: (job id, final state, its log)."""
    job_id = _submit(log_dir, *args)
    log = log_dir / f"grpo-mega-{job_id}.out"
    try:
        state = _final_state(job_id, log)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    return job_id, state, log.read_text()


def _wait_for(predicate, timeout: float, what: str, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    text = log.read_text()[-4000:] if log.exists() else "(no log)"
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], capture_output=True, text=True, timeout=30).stdout
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t %E"], capture_output=True, text=True, timeout=30).stdout
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; queue (job state reason):\n{queue}nodes:\n"
                f"{nodes}log:\n{text}")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [row["step"] for row in read_metrics(path)] if path.exists() and path.read_text().strip() else []


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


# ----------------------------------------------------------------------------- the PRM stages and the pipeline
@pytest.fixture(scope="module")
def prm_policy(task, tmp_path_factory):
    """An HF folder with seeded random weights of the tiny task's model and its tokenizer: the labelling policy
    and the PRM's initial backbone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir, _ = task
    policy_dir = tmp_path_factory.mktemp("prm_policy") / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(policy_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (policy_dir / name).write_bytes((model_dir / name).read_bytes())
    return policy_dir


def _label_env(task, policy_dir: Path, labels: Path) -> dict[str, str]:
    # A random policy rarely writes "Step k:": steps are cut every 6 characters so that there are prefixes to
    # continue (n=2 continuations each).
    return {"LABEL_POLICY": str(policy_dir), "LABEL_PROMPTS": str(task[1]), "LABELS": str(labels),
            "LABEL_ARGS": "--n 2 --max-prompts 4 --max-new-tokens 12 --step-pattern .{6} --device cpu --seed 3"}


def _prm_overrides(task, policy_dir: Path, run_dir: Path, total_steps: int, *extra: str) -> list[str]:
    return [f"model.hf_config={task[0]}", f"model.init_from={policy_dir}", f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={total_steps}", "trainer.batch_size=4", "trainer.progress_bar=false",
            "trainer.tensorboard=false", "parallel.device=cpu", "optim.warmup_steps=0", *extra]


def _logged_steps(run_dir: Path) -> list[int]:
    """Every step line of metrics.jsonl in order, repeats included."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _labels(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_pipeline_labels_trains_the_prm_through_a_requeue_then_runs_process_supervised_grpo(cluster, task,
                                                                                           prm_policy, tmp_path):
    """pipeline.sh: the PRM job labels (2 ranks), trains the PRM (TP=2), gets USR1 mid-training, saves, requeues,
    skips the finished labelling and resumes; the GRPO job waits on its dependency through all of it, then runs a
    process-supervised step with that PRM."""
    labels, prm_run, grpo_run = tmp_path / "labels.jsonl", tmp_path / "prm", tmp_path / "grpo"
    total = 40  # a tiny PRM step takes a fraction of a second: room for the signal to arrive mid-run
    env = _job_env(PRM_CONFIG=str(PRM_CONFIG), GRPO_CONFIG=str(CONFIG), **_label_env(task, prm_policy, labels),
                   PRM_SBATCH=" ".join([*cpu_node_options(), f"--output={tmp_path}/%x-%j.out"]),
                   GRPO_SBATCH=" ".join([*cpu_node_options(), f"--output={tmp_path}/%x-%j.out"]))
    # Two GRPO steps: this job is also the suite's plain train.sbatch run (submitted, run to the end on one node
    # without a restart, every step logged), which a test of its own would pay a whole job's start-up for.
    grpo = _overrides(task, grpo_run, "trainer.total_steps=2", "algorithm.supervision=process",
                      "process_reward.source=prm", f"process_reward.prm={prm_run}")
    args = [*_prm_overrides(task, prm_policy, prm_run, total), "--", *grpo]
    result = subprocess.run(["bash", str(PIPELINE), *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    ids = dict(re.findall(r"^(prm_job|grpo_job)=(\d+)$", result.stdout, re.MULTILINE))
    prm_job, grpo_job = ids["prm_job"], ids["grpo_job"]
    prm_log, grpo_log = tmp_path / f"grpo-mega-prm-{prm_job}.out", tmp_path / f"grpo-mega-{grpo_job}.out"

    def held() -> bool:
        job = _job(grpo_job)
        return (job["JobState"], job["Reason"]) == ("PENDING", "Dependency") and job["Dependency"].startswith(
            f"afterok:{prm_job}")

    def pending_then_held() -> bool:
        job = _job(grpo_job)
        assert job["JobState"] == "PENDING", job  # it never starts before the PRM job completes
        return held()  # right after sbatch the reason reads None until the scheduler has looked at the job

    try:
        _wait_for(pending_then_held, 60, "the GRPO job to wait on its dependency", grpo_log)
        _wait_for(lambda: _logged_steps(prm_run), 240, "PRM step 1 in metrics.jsonl", prm_log)
        subprocess.run(["scancel", "--signal=USR1", "--batch", prm_job], check=True, timeout=30)
        _wait_for(lambda: "requeueing" in prm_log.read_text(), 120, "the batch script to requeue the job", prm_log)
        labelled = labels.read_text()
        # A requeued job starts again after the job credential lifetime (AuthInfo=cred_expire=5 on the test
        # cluster); the GRPO job stays held: the requeued PRM job has not completed.
        _wait_for(lambda: "SLURM_RESTART_COUNT=1" in prm_log.read_text(), 240, "the PRM job to restart", prm_log)
        assert held(), _job(grpo_job)
        assert _final_state(prm_job, prm_log) == "COMPLETED", prm_log.read_text()[-4000:]
        assert _final_state(grpo_job, grpo_log) == "COMPLETED", grpo_log.read_text()[-4000:]
    finally:
        subprocess.run(["scancel", prm_job, grpo_job], capture_output=True, timeout=30)
    assert _job(grpo_job)["StartTime"] >= _job(prm_job)["EndTime"]  # ISO times compare as strings

    # Labels: a row per non-empty solution of the 4 prompts, one label per step, from 2 ranks; written once.
    rows, summary = _labels(labels), json.loads(Path(f"{labels}.summary.json").read_text())
    assert summary["prompts"] == 4 and summary["world_size"] == 2
    assert len(rows) == summary["solutions"] >= 1
    assert all(len(row["labels"]) == len(row["completions"]) >= 1 for row in rows)
    assert labels.read_text() == labelled

    # The stop: both ranks after the same step (they agree through an all-reduce); the restart resumes there.
    text = prm_log.read_text()
    stopped = [int(n) for n in re.findall(r"grpo-mega prm train: stopped after step (\d+)", text)]
    assert len(stopped) == 2 and stopped[0] == stopped[1] and 1 <= stopped[0] < total, text[-4000:]
    first, second = text.split("SLURM_RESTART_COUNT=1")
    assert "USR1 received" in first and "step label exited with status 0" in first
    assert "labelling skipped" in second and ": step label " not in second  # the job's step, not a log's words
    assert re.search(rf"resumed from \S*step_{stopped[0]:06d} at step {stopped[0]}", second), second[-4000:]
    # Every PRM step logged exactly once across the two runs, and the final checkpoint written.
    assert _logged_steps(prm_run) == list(range(1, total + 1))
    assert json.loads((prm_run / "checkpoints" / f"step_{total:06d}" / "complete.json").read_text())["step"] == total

    # The GRPO job ran once, both steps, and each scored its rollouts' steps with the PRM.
    grpo_text = grpo_log.read_text()
    assert "SLURM_RESTART_COUNT=0" in grpo_text and "SLURM_RESTART_COUNT=1" not in grpo_text, grpo_text[-4000:]
    assert _job(grpo_job)["Restarts"] == "0"
    grpo_rows = read_metrics(grpo_run / "metrics.jsonl")
    assert [row["step"] for row in grpo_rows] == [1, 2]
    assert all("timing_s/prm" in row for row in grpo_rows), [sorted(row) for row in grpo_rows]


# ----------------------------------------------------------------------------- faults: the requeue policy
# (launch/slurm/common.sh; its branches on written logs in test_slurm_faults.py)
@pytest.mark.slow
def test_a_killed_rank_requeues_the_job_which_resumes_and_completes(cluster, task, tmp_path):
    run_dir, total = tmp_path / "run", 8
    job_id = _submit(tmp_path, *_overrides(task, run_dir, f"trainer.total_steps={total}", "trainer.save_every=2",
                                           "trainer.collective_timeout_s=20"))
    log = tmp_path / f"grpo-mega-{job_id}.out"
    try:
        _wait_for(lambda: len(_steps(run_dir)) >= 3, 240, "step 3 in metrics.jsonl", log)
        victim = _rank_pid(1, run_dir)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)  # as the OOM killer or a crashed driver would
        _wait_for(lambda: "SLURM_RESTART_COUNT=1" in log.read_text(), 240, "the job to restart", log)
        state = _final_state(job_id, log)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    first, second = text.split("SLURM_RESTART_COUNT=1")
    assert re.search(r"transient fault \(cause=[a-z_ :]+.*\), fault requeue 1 of 3; requeueing", first), first[-3000:]
    resumed = re.search(r"resumed from \S*step_(\d+) at step (\d+)", second)
    assert resumed and int(resumed.group(1)) % 2 == 0 and int(resumed.group(1)) >= 2, second[-3000:]
    # one metrics row per step (a step logged before the kill and run again after the resume keeps its newer row)
    assert _steps(run_dir) == list(range(1, total + 1))
    assert _job(job_id)["Restarts"] == "1"


@pytest.mark.slow
def test_a_corrupt_data_row_fails_the_job_without_a_requeue(cluster, task, tmp_path):
    model_dir, train_file = task
    corrupt = tmp_path / "train.jsonl"
    lines = train_file.read_text().splitlines()
    corrupt.write_text("\n".join([*lines[:3], '{"prompt": "1+1=", "answer"', *lines[3:]]) + "\n")
    run_dir = tmp_path / "run"
    job_id, state, text = _run_to_the_end(tmp_path, *_overrides((model_dir, corrupt), run_dir,
                                                                "trainer.total_steps=2", "data.on_bad_row=error"))
    assert state == "FAILED", text[-4000:]
    assert "failed (cause=data), which a restart would repeat; not requeueing" in text
    assert "SLURM_RESTART_COUNT=1" not in text and _job(job_id)["Restarts"] == "0"
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["cause"] == "data" and f"{corrupt}:4" in failure["exception"]
