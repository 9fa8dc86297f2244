"""What a run prints on rank 0 with ``trainer.progress_bar=false``: one line per step with the trainer's figures
(a held-out figure only on the steps that evaluated), and the summary line at the end (grpo_mega.run.progress)."""

import io
import math
import re
from pathlib import Path

from grpo_mega.run.metrics import MetricsLogger
from grpo_mega.run.progress import StepProgress, forget_skipped_rows
from grpo_mega.trainer import GRPO_SHOWN


def test_a_line_per_step_with_the_figures_of_its_row(tmp_path):
    forget_skipped_rows()  # as a run's harness does first: no bad rows an earlier test's loader noted in this process
    out = io.StringIO()
    progress = StepProgress(total_steps=3, start_step=0, shown=GRPO_SHOWN, bar=False, out=out)
    progress.record(0, {"eval/accuracy": 0.125}, advance=False)
    progress.record(1, {"critic/score/mean": 0.25, "critic/rewards/mean": 0.2, "actor/lr": 1e-3})
    progress.record(2, {"critic/score/mean": 0.5, "critic/rewards/mean": math.nan, "eval/accuracy": 0.375})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"step 0/3 \(before training\)  accuracy 0\.125  \d+\.\d s", lines[0])
    assert re.fullmatch(r"step 1/3  score 0\.250  reward 0\.200  \d+\.\d s", lines[1])
    assert re.fullmatch(r"step 2/3  score 0\.500  accuracy 0\.375  \d+\.\d s", lines[2])  # a NaN is left out

    summary = progress.summary("grpo-mega train", wall_seconds=12.4, checkpoint=Path("runs/x/checkpoints/step_2"),
                               stop_reason="SIGTERM")
    assert summary == ("grpo-mega train: stopped early (SIGTERM), 2/3 steps: score 0.500, reward 0.200 (step 1), "
                       "accuracy 0.375; 12 s; last checkpoint runs/x/checkpoints/step_2")


def test_a_resumed_run_says_where_it_resumed_and_a_run_without_figures_says_no_more(tmp_path):
    forget_skipped_rows()
    progress = StepProgress(total_steps=4, start_step=2, shown={"nll": "sft/nll"}, bar=False, out=io.StringIO())
    assert progress.summary("grpo-mega sft", wall_seconds=3, checkpoint=None) == (
        "grpo-mega sft: done, 2/4 steps (resumed after step 2); 3 s; no checkpoint")
    progress.record(3, {"sft/nll": 1.5})
    progress.record(4, {"sft/nll": 1.25})
    assert progress.summary("grpo-mega sft", wall_seconds=3, checkpoint=None) == (
        "grpo-mega sft: done, 4/4 steps (resumed after step 2): nll 1.250; 3 s; no checkpoint")


def test_the_metrics_log_prints_the_lines_on_rank_0_only(tmp_path, capsys):
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress_bar=False, shown={"loss": "prm/loss"})
    log.log(1, {"prm/loss": 0.5})
    log.close()
    MetricsLogger(tmp_path / "other", total_steps=2, active=False, progress_bar=False).log(1, {"prm/loss": 0.5})
    assert re.fullmatch(r"step 1/2  loss 0\.500  \d+\.\d s\n", capsys.readouterr().out)


def test_bad_rows_are_said_once_and_in_the_done_line(tmp_path, monkeypatch, caplog):
    """Issue 79 item 6: every rank logged the rows it skipped (the same rows, twice on 2 ranks) and the `done` line
    did not name them; rank 0 logs them and the done line counts them per file."""
    import logging

    from grpo_mega.data.prompts import BadRows
    from grpo_mega.run import progress as progress_module

    monkeypatch.setattr(progress_module, "_SKIPPED_ROWS", {})
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with caplog.at_level(logging.WARNING, logger="grpo_mega.data.prompts"):
            rows = BadRows("skip")
            rows.reject("train.jsonl:3", "missing answer field 'answer'")
            rows.reject("train.jsonl:9", "prompt has 80 tokens, more than prompt_length=64")
            rows.finish(8, "train.jsonl")
        said = [record.getMessage() for record in caplog.records]
        assert said == ([] if rank == "1" else ["skipping train.jsonl:3: missing answer field 'answer'",
                                                "skipping train.jsonl:9: prompt has 80 tokens, more than "
                                                "prompt_length=64", "skipped 2 of 10 rows in train.jsonl"])
    progress = StepProgress(total_steps=2, start_step=0, shown={}, bar=False, out=io.StringIO())
    progress.record(2, {})
    assert progress.summary("grpo-mega train", wall_seconds=5, checkpoint=None).endswith(
        "no checkpoint; skipped 2 bad rows of train.jsonl (the first: train.jsonl:3: missing answer field 'answer')")
