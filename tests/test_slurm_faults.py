"""The SLURM scripts' requeue policy on faults (launch/slurm/common.sh, issue 37): a job requeues itself after a
transient fault (a rank killed, a peer lost, a hang) and resumes from its last complete checkpoint, at most
GRPO_MAX_FAULT_REQUEUES times; it does not requeue on a fault a restart would repeat (a bad config, a corrupt data
row, a NaN loss, a full disk), so a requeue loop cannot burn an allocation.

The policy is read from the failure line the ranks print (``failed (cause=...)``, ``grpo_mega.run.failure``). It is
tested here on logs written by the test (every branch, no cluster), and on a real one-node cluster in
tests/test_slurm.py (a rank SIGKILLed mid-run, a dataset with a corrupt row; there, so that one pytest worker runs
every job of that cluster) and a two-node one in tests/test_slurm_two_nodes.py (a node lost)."""

import os
import re
import subprocess
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
COMMON = REPO / "launch" / "slurm" / "common.sh"
JOB = "77"


def _finish(tmp_path: Path, log_lines: list[str], status: int, *, max_requeues: int = 3) -> tuple[int, str]:
    """Run common.sh's grpo_finish_training_step STATUS on a job log of ``log_lines`` (this restart's part starts
    at the last "SLURM_RESTART_COUNT" line); ``scontrol`` only prints what it was asked. Returns (exit status,
    output)."""
    log = tmp_path / "job.out"
    log.write_text("".join(f"{line}\n" for line in log_lines))
    start = max(i for i, line in enumerate(log_lines) if "SLURM_RESTART_COUNT" in line)
    script = f"""
source {COMMON}
scontrol() {{ echo "scontrol $*"; }}
log_file={log} log_start={start} SLURM_JOB_ID={JOB} stop_requested=0 GRPO_MAX_FAULT_REQUEUES={max_requeues}
grpo_finish_training_step {status} 'grpo-mega train: stopped after step'
"""
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    return result.returncode, result.stdout + result.stderr


def _failed(rank: int, cause: str, written: bool) -> str:
    return (f"grpo-mega train: rank {rank} on n{rank} failed (cause={cause}) at step 5 (update (x)): Error: a (b): c"
            + ("; /runs/a/failure.json" if written else ""))


START = f"=== grpo-mega job {JOB} grpo-mega SLURM_RESTART_COUNT=0 nodes=n1"


@pytest.mark.parametrize("cause", ["config", "data", "non_finite", "disk_full", "error"])
def test_a_fault_a_restart_would_repeat_is_not_requeued(tmp_path, cause):
    # the rank that wrote failure.json named the cause; its peer, which lost it, says peer_lost (transient)
    status, output = _finish(tmp_path, [START, _failed(0, "peer_lost", False), _failed(1, cause, True)], 1)
    assert status == 1 and "scontrol requeue" not in output
    assert f"failed (cause={cause}), which a restart would repeat; not requeueing" in output


@pytest.mark.parametrize("cause", ["collective_timeout", "peer_lost", "phase_timeout", "hardware", "terminated", None])
def test_a_transient_fault_is_requeued(tmp_path, cause):
    lines = [START] + ([_failed(1, cause, True)] if cause else [])  # None: the ranks died without a word
    status, output = _finish(tmp_path, lines, 1)
    assert status == 0 and f"scontrol requeue {JOB}" in output
    named = cause or "none named: a rank or node died without a word"
    assert f"transient fault (cause={named}), fault requeue 1 of 3; requeueing" in output


def test_fault_requeues_are_counted_over_the_job_and_capped(tmp_path):
    earlier = []
    for restart in range(2):  # two earlier runs of this job ended in transient faults and requeued
        earlier += [START.replace("COUNT=0", f"COUNT={restart}"), _failed(1, "peer_lost", True),
                    f"=== grpo-mega job {JOB}: transient fault (cause=peer_lost), fault requeue {restart + 1} of 2; "
                    "requeueing"]
    lines = [*earlier, START.replace("COUNT=0", "COUNT=2"), _failed(0, "collective_timeout", True)]
    status, output = _finish(tmp_path, lines, 1, max_requeues=2)
    assert status == 1 and "scontrol requeue" not in output
    assert "failed (cause=collective_timeout) after 2 fault requeues (GRPO_MAX_FAULT_REQUEUES=2); not requeueing" \
        in output
    # the causes of earlier runs are not this run's: a deterministic cause before the restart does not stop it
    status, output = _finish(tmp_path, [START, _failed(1, "data", True), START.replace("COUNT=0", "COUNT=1")], 1)
    assert status == 0 and "cause=none named" in output


def test_a_finished_step_and_a_stop_with_a_checkpoint_are_as_before(tmp_path):
    assert _finish(tmp_path, [START, _failed(1, "data", True)], 0) == (0, "")
    status, output = _finish(tmp_path, [START, "grpo-mega train: stopped after step 4 (signal SIGTERM)"], 1)
    assert status == 0 and "stopped early with a checkpoint; requeueing" in output


def test_torchruns_grace_fits_a_step_and_a_save_inside_the_usr1_lead():
    """torchrun SIGKILLs the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT after it forwarded SIGTERM (30 s by default, less
    than one GRPO step of a 7B model): the scripts raise it, and keep it inside the USR1 lead so the requeue fits."""
    result = subprocess.run(["bash", "-c", f"source {COMMON}; scontrol() {{ :; }}; SLURM_JOB_ID=1 grpo_job_setup "
                             ">/dev/null; echo $TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], capture_output=True, text=True,
                            timeout=30, env={k: v for k, v in os.environ.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"})
    grace = int(result.stdout.split()[-1])
    for script in ("train.sbatch", "prm.sbatch"):
        lead = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", (COMMON.parent / script).read_text()).group(1))
        assert 120 <= grace <= lead - 30, (grace, lead)
