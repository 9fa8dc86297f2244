"""A short chaos schedule (issue 61, bench/chaos.py): one 2-rank GRPO run (its ranks forked by grpo-mega's launcher) with process supervision by a learned PRM
meets five faults of five kinds, one after the other in the same run folder (a checkpoint altered after its save, a
rank killed while it resumes, a rank killed inside a save, the PRM scorer raising, the scheduler's SIGUSR1), each
followed by a restart of the same command, and must end as ONE uninterrupted run of that command does: the final
checkpoint bit-equal, every metrics row and every step's prompts equal, every cause named (failure.json and its
history, the stop line, the altered file refused by its checksum and the fallback said)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import chaos  # noqa: E402  (bench/chaos.py)
from chaos_checks import compare_checkpoints  # noqa: E402
from grpo_mega.run.layout import step_dir_name  # noqa: E402

KINDS = "altered,resume_kill,save_kill,prm_exception,usr1"
STEPS = 12


def test_a_run_that_meets_five_faults_ends_bit_equal_to_an_uninterrupted_run(tmp_path):
    out = tmp_path / "chaos.json"
    chaos.main(["--seed", "3", "--faults", "5", "--steps", str(STEPS), "--save-every", "2", "--kinds", KINDS,
                "--ranks", "forked", "--timeout", "15", "--work", str(tmp_path / "work"), "--out", str(out)])
    record = json.loads(out.read_text())["schedules"][f"prm-local-forked-seed3-faults5-steps{STEPS}"]
    summary, faults = record["summary"], record["faults"]
    assert sorted(fault["kind"] for fault in faults) == sorted(KINDS.split(","))
    assert summary["faults_met"] == 5 and summary["ended"], json.dumps(faults, indent=1)
    assert summary["bit_equal"], record["checks"]["weights"]
    assert summary["metrics_equal"], record["checks"]["metrics_rows_different"]
    assert (summary["prompts_lost"], summary["prompts_repeated"]) == (0, 0) and record["checks"]["prompts_equal"]
    assert summary["causes_named"] == 5, [(f["kind"], f["record"].get("named_by")) for f in faults]
    assert summary["failures_in_history"] == summary["failures"] == 4  # all but the USR1 stop
    altered = next(fault["record"] for fault in faults if fault["kind"] == "altered")
    assert altered["altered"] and altered["fallback_expected"] != altered["checkpoint"]
    assert all(fault["record"]["seconds_to_exit"] > 0 and fault["record"]["seconds_to_next_step"] > 0
               for fault in faults)
    # The check tells checkpoints apart: the final one against the reference's checkpoint two steps earlier.
    run_checkpoints = Path(record["checks"]["weights"]["checkpoint"])
    reference = tmp_path / "work" / f"reference-prm-forked-{STEPS}-2" / "run" / "checkpoints"
    assert run_checkpoints.name == step_dir_name(STEPS)
    earlier = compare_checkpoints(reference / step_dir_name(STEPS), reference / step_dir_name(STEPS - 2))
    assert not earlier["bit_equal"] and earlier["different"]


def test_a_fault_named_in_the_fault_file_is_planted_until_its_mark_exists(tmp_path, monkeypatch):
    """Under SLURM a requeued job restarts with the environment it was submitted with: the fault of each attempt is
    read from GRPO_FAULT_FILE as the ranks start, and one that fired (its mark written) is not planted again."""
    import fault_inject

    spec, mark = tmp_path / "fault.json", tmp_path / "attempt03.fault_at"
    monkeypatch.setenv("GRPO_FAULT", "exception:0:1")  # the file takes its place
    monkeypatch.setenv("GRPO_FAULT_FILE", str(spec))
    monkeypatch.delenv("GRPO_FAULT_MARK", raising=False)
    assert fault_inject._fault_spec() is None  # no file yet: no fault
    spec.write_text(json.dumps({"fault": "save_kill:1:7", "mark": str(mark)}))
    assert fault_inject._fault_spec() == "save_kill:1:7"
    monkeypatch.setenv("GRPO_FAULT_MARK", "elsewhere")
    assert fault_inject._fault_spec() == "save_kill:1:7"
    assert os.environ["GRPO_FAULT_MARK"] == str(mark)  # the clock the bench reads is this attempt's
    mark.write_text("1.0\n")
    assert fault_inject._fault_spec() is None
    spec.write_text(json.dumps({"fault": None, "mark": str(tmp_path / "attempt04.fault_at")}))
    assert fault_inject._fault_spec() is None


def test_each_slurm_attempt_reads_its_own_part_of_the_appended_job_log():
    """The SLURM supervisor's attempts are the runs of one job (its requeues), all appending to one log."""
    import chaos_slurm

    log = ("=== grpo-mega job 7 grpo-mega SLURM_RESTART_COUNT=0 nodes=gmnode[1-2] t0\n"
           "=== grpo-mega job 7: step train: grpo-mega train ...\nfirst run\n"
           "=== grpo-mega job 7: transient fault (cause=peer_lost), fault requeue 1 of 1000; requeueing\n"
           "=== grpo-mega job 7 grpo-mega SLURM_RESTART_COUNT=1 nodes=gmnode[1-2] t1\nsecond run\n"
           "=== grpo-mega job 7 grpo-mega SLURM_RESTART_COUNT=10 nodes=gmnode[1-2] t2\neleventh run\n")
    first = chaos_slurm.log_part(log, "7", 0)
    assert "first run" in first and "; requeueing" in first and "second run" not in first
    assert chaos_slurm.log_part(log, "7", 1).splitlines()[1:] == ["second run"]
    assert chaos_slurm.log_part(log, "7", 10).splitlines()[1:] == ["eleventh run"]
    assert chaos_slurm.log_part(log, "7", 2) == "" and chaos_slurm.log_part(log, "70", 0) == ""
