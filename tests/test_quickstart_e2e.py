"""End to end: the shortened quickstart runs data -> SFT (TP=2) -> GRPO (TP=2) -> eval and writes its summary."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_fast_quickstart_writes_summary_plot_and_checkpoints(tmp_path):
    run_dir = tmp_path / "quickstart"
    result = subprocess.run(
        [sys.executable, "-m", "grpo_mega.cli", "quickstart", "--fast", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[-1] == str(run_dir / "summary.json")
    summary = json.loads(Path(lines[-1]).read_text())
    for key in ("accuracy_before", "accuracy_after", "steps", "wall_seconds"):
        assert key in summary
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["steps"] == 3
    assert Path(summary["plot"]).stat().st_size > 1000
    # the GRPO stage logged verl-style metrics every step and left a complete checkpoint
    rows = [json.loads(line) for line in (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines()]
    step_rows = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in step_rows] == [1, 2, 3]
    for name in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "timing_s/gen",
                 "timing_s/update", "timing_s/sync", "perf/throughput", "response_length/mean"):
        assert name in step_rows[-1], name
    assert list((run_dir / "grpo" / "checkpoints").glob("step_000003"))
