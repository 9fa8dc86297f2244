"""What a run prints on rank 0 with ``trainer.progress_bar=false``: one line per step with the trainer's figures
(a held-out figure only on the steps that evaluated), and the summary line at the end (grpo_mega.run.progress)."""

import io
import math
import re
from pathlib import Path

from grpo_mega.run.metrics import MetricsLogger
from grpo_mega.run.progress import SkippedRows, StepProgress, collect_skipped_rows
from grpo_mega.trainer import GRPO_SHOWN


def test_a_line_per_step_with_the_figures_of_its_row(tmp_path):
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


def _read_with_bad_rows(source: str, *bad: str, kept: int = 8) -> None:
    """A loader's read of ``source`` that skips the rows ``bad`` (``file:line: why``) and keeps ``kept``."""
    from grpo_mega.data.prompts import BadRows

    rows = BadRows("skip")
    for row in bad:
        location, why = row.split(": ", 1)
        rows.reject(location, why)
    rows.finish(kept, source)


def test_bad_rows_are_said_once_and_in_the_done_line(monkeypatch, caplog):
    """Issue 79 item 6: every rank logged the rows it skipped (the same rows, twice on 2 ranks) and the `done` line
    did not name them; rank 0 logs them and the done line counts them per file."""
    import logging

    record = SkippedRows()
    collect_skipped_rows(record)  # as RunHarness does first
    try:
        for rank in ("1", "0"):
            monkeypatch.setenv("RANK", rank)
            with caplog.at_level(logging.WARNING, logger="grpo_mega.data.prompts"):
                _read_with_bad_rows("train.jsonl", "train.jsonl:3: missing answer field 'answer'",
                                    "train.jsonl:9: prompt has 80 tokens, more than prompt_length=64")
            said = [line.getMessage() for line in caplog.records]
            assert said == ([] if rank == "1" else ["skipping train.jsonl:3: missing answer field 'answer'",
                                                    "skipping train.jsonl:9: prompt has 80 tokens, more than "
                                                    "prompt_length=64", "skipped 2 of 10 rows in train.jsonl"])
    finally:
        collect_skipped_rows(None)
    progress = StepProgress(total_steps=2, start_step=0, shown={}, bar=False, out=io.StringIO())
    progress.record(2, {})
    assert progress.summary("grpo-mega train", wall_seconds=5, checkpoint=None, skipped_rows=record).endswith(
        "no checkpoint; skipped 2 bad rows of train.jsonl (the first: train.jsonl:3: missing answer field 'answer')")


def test_a_file_read_twice_keeps_both_counts_and_a_read_outside_a_run_keeps_none():
    """Issue 79: the record was one process-global dict keyed by file, so a second read of a file replaced the
    first one's count (a train file that is also the eval file, read with another prompt length), and a read
    outside any run (``prm label``, ``eval`` in the same process) stayed there for whatever read it next."""
    outside = SkippedRows()
    collect_skipped_rows(outside)
    collect_skipped_rows(None)  # as RunHarness.finish leaves it
    _read_with_bad_rows("data.jsonl", "data.jsonl:4: missing answer field 'answer'")
    assert outside.reads == []

    run = SkippedRows()
    collect_skipped_rows(run)
    try:
        _read_with_bad_rows("data.jsonl", "data.jsonl:4: missing answer field 'answer'")
        _read_with_bad_rows("data.jsonl", "data.jsonl:4: missing answer field 'answer'")  # another rank: the same
        _read_with_bad_rows("data.jsonl", "data.jsonl:2: prompt has 40 tokens, more than prompt_length=32",
                            "data.jsonl:4: missing answer field 'answer'")
    finally:
        collect_skipped_rows(None)
    assert run.text() == ("; skipped 1 bad row of data.jsonl (the first: data.jsonl:4: missing answer field 'answer')"
                          "; skipped 2 bad rows of data.jsonl (the first: data.jsonl:2: prompt has 40 tokens, more "
                          "than prompt_length=32)")
    assert SkippedRows().text() == ""  # the next run starts with none


def test_in_async_mode_the_rollout_worlds_bad_train_rows_reach_the_trainers_done_line():
    """``rollout.mode: async``: the rollout world reads the train file, the trainer never does; its reads come with
    each batch (the payload that carries the rollout-side metrics) and the trainer's done line names them."""
    from grpo_mega.stages.rollout_feed import RolloutFeed

    rollout_world = SkippedRows()
    rollout_world.note("train.jsonl", 3, "train.jsonl:5: missing answer field 'answer'")

    class Bridge:  # the trainer's end of the bridge, as the rollout world's sends arrive
        def __init__(self):
            self.sent = [("batch", {"step": 1, "batch": None, "metrics": {}, "prompts": {"epoch": 0},
                                    "stop_signal": None, "skipped_rows": list(rollout_world.reads)})]

        def receive(self):
            return self.sent.pop(0)

    feed = RolloutFeed.__new__(RolloutFeed)  # its bridge end alone, no process group
    feed.bridge, feed.pending, feed.evals, feed.skipped_rows = Bridge(), {}, {}, []
    feed._receive_until(lambda: 1 in feed.pending)
    trainer = SkippedRows()
    trainer.note("eval.jsonl", 1, "eval.jsonl:2: missing answer field 'answer'")  # the trainer reads the eval file
    trainer.merge(feed.skipped_rows)
    progress = StepProgress(total_steps=1, start_step=0, shown={}, bar=False, out=io.StringIO())
    progress.record(1, {})
    assert progress.summary("grpo-mega train", wall_seconds=5, checkpoint=None, skipped_rows=trainer).endswith(
        "; skipped 1 bad row of eval.jsonl (the first: eval.jsonl:2: missing answer field 'answer')"
        "; skipped 3 bad rows of train.jsonl (the first: train.jsonl:5: missing answer field 'answer')")
