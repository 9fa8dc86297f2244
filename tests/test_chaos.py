"""A short chaos schedule (issue 61, bench/chaos.py): one 2-rank GRPO run with process supervision by a learned PRM
meets five faults of five kinds, one after the other in the same run folder (a checkpoint altered after its save, a
rank killed while it resumes, a rank killed inside a save, the PRM scorer raising, the scheduler's SIGUSR1), each
followed by a restart of the same command, and must end as ONE uninterrupted run of that command does: the final
checkpoint bit-equal, every metrics row and every step's prompts equal, every cause named (failure.json and its
history, the stop line, the altered file refused by its checksum and the fallback said)."""

from __future__ import annotations

import json
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
                "--timeout", "15", "--work", str(tmp_path / "work"), "--out", str(out)])
    record = json.loads(out.read_text())["schedules"][f"prm-local-seed3-faults5-steps{STEPS}"]
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
    reference = tmp_path / "work" / f"reference-prm-{STEPS}-2" / "run" / "checkpoints"
    assert run_checkpoints.name == step_dir_name(STEPS)
    earlier = compare_checkpoints(reference / step_dir_name(STEPS), reference / step_dir_name(STEPS - 2))
    assert not earlier["bit_equal"] and earlier["different"]
