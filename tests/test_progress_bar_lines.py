"""Issue 79 item 10: with ``trainer.progress_bar`` on, a log line during the run (a checkpoint saved) was glued to
the bar's line and the bar drawn again after it (the bar twice at the end), and a failure's cause was glued to the
bar. Log lines now go above the bar, and a failure's line starts a line of its own."""

from __future__ import annotations

import logging
import re
import sys

from grpo_mega.run.failure import report_failure
from grpo_mega.run.progress import StepProgress


def test_a_log_line_goes_above_the_bar_and_the_bar_ends_once(capsys):
    handler = logging.StreamHandler(sys.stderr)  # the console logging of the command (logging.basicConfig)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = StepProgress(total_steps=2, start_step=0, shown={"score": "critic/score/mean"}, bar=True)
        for step in (1, 2):
            progress.record(step, {"critic/score/mean": 0.5})
            logging.getLogger("grpo_mega.checkpoint.training").warning("saved checkpoint step_%06d", step)
        progress.close()
        progress.close()  # the harness and a failure may both end it: once
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    for line in err.split("\n"):
        if "saved checkpoint" in line:  # what a terminal shows of it: after its last carriage return
            assert "%|" not in line.split("\r")[-1], repr(line)  # not glued to the bar
    assert re.search(r"saved checkpoint step_000002\n.*2/2 \[", err), repr(err)  # the bar after the last log line
    assert err.count("saved checkpoint") == 2
    assert err.endswith("\n")


def test_a_failure_line_starts_a_line_of_its_own(capsys):
    progress = StepProgress(total_steps=3, start_step=0, shown={}, bar=True)
    progress.record(1, {})
    report_failure("grpo-mega train", None, RuntimeError("boom"))
    err = capsys.readouterr().err
    failure = [line for line in err.split("\n") if "boom" in line]
    assert len(failure) == 1 and failure[0].startswith("grpo-mega train"), repr(err)
    assert progress.bar is None
