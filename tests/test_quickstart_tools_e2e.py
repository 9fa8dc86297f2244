"""End to end: ``grpo-mega quickstart --regime tools --fast`` writes the tool task in its two surface forms and its
tokenizer, runs the tool SFT (tool turns masked) and the text-only SFT on 2 processes, measures the text-only
policy with ``grpo-mega eval``, picks the sparse start (the tool checkpoints through the turn loop) and writes its
summary (about a minute on an idle 2-core machine)."""

import json
from pathlib import Path

import pytest
from cli_runner import run_grpo_mega


@pytest.mark.slow
def test_the_tool_regime_runs_both_sfts_and_writes_its_summary(tmp_path):
    run_dir = tmp_path / "tools"
    result = run_grpo_mega("quickstart", "--regime", "tools", "--fast", "--run-dir", str(run_dir), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[-1] == str(run_dir / "summary.json")
    summary = json.loads(Path(lines[-1]).read_text())
    assert summary["regime"] == "tools" and 0.0 <= summary["text_sft_pass_at_1"] <= 1.0
    sparse = summary["sparse_start"]  # both "more" checkpoints measured through the turn loop (none passes 20 %)
    assert list(sparse["tool_pass_at_1"]) == ["1", "2"] and sparse["more_sft_step"] in (1, 2)
    assert Path(sparse["tool_checkpoint"]).is_dir() and Path(sparse["text_checkpoint"]).is_dir()
    assert "sparse start (GRPO arms): after" in result.stdout
    row = json.loads((run_dir / "data" / "train.jsonl").read_text().splitlines()[0])
    assert row["solution"].endswith(f"The answer is {row['answer']}.")
    assert row["tool_segments"][1]["tool"] and row["tool_segments"][1]["text"].startswith("<tool_response>")
    for arm in ("text", "tool"):
        metrics = [json.loads(line) for line in (run_dir / f"sft_{arm}" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if "sft/nll" in m][-1] == 6


def test_grpo_arm_options_are_refused_for_the_tool_regime(tmp_path):
    result = run_grpo_mega("quickstart", "--regime", "tools", "--iterations", "2", "--run-dir", str(tmp_path / "tools"))
    assert result.returncode == 2 and "--iterations" in result.stderr and not (tmp_path / "tools").exists()
