"""The chaos sweep's triggers (bench/chaos_faults.py) are counted from the checkpoint the next attempt resumes from,
not from the newest metrics row: an attempt that dies after logging a step and before saving its checkpoint leaves
rows that the resume drops and trains again. Counted from those rows, every such death pushed the later triggers one
step or more too far, and the async seed 2 sweep met only 18 of its 20 faults (the last two lay past the run's end).
And while an attempt runs, only the rows it logged say which step it reached: a stale row must not set a fault off
before the resume even dropped it. No training run: a run folder written by hand, its metrics rows dropped by the
library's own ``drop_rows_after`` as a resume drops them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import chaos  # noqa: E402  (bench/chaos.py: the variants' rollout rank and lead)
from chaos_faults import (Fault, attempt_start, attempt_steps, poll_attempt, resume_step, step_reached,  # noqa: E402
                          trigger_now)
from checkpoint_layout import write_published_checkpoint  # noqa: E402
from grpo_mega.run.metrics import drop_rows_after  # noqa: E402

LEAD = chaos.ROLLOUT_LEAD["async"]


def _checkpoint(run_dir: Path, step: int) -> Path:
    """A complete published checkpoint of ``step`` with placeholder weights."""
    return write_published_checkpoint(
        run_dir, step, state={"format": "grpo_mega.training_checkpoint", "version": 1, "step": step},
        config_yaml="trainer: {}\n")


def _log(run_dir: Path, *steps: int, time: float = 0.5) -> None:
    """Rows of ``steps`` as MetricsLogger appends them (``time``: seconds since its start, before the step's)."""
    with open(run_dir / "metrics.jsonl", "a") as out:
        for step in steps:
            out.write(json.dumps({"step": step, "time": time + step, "loss": 0.25}) + "\n")


def _died_after_logging_step_8(run_dir: Path) -> None:
    """Checkpoints of steps 3 and 6; rows of steps 1-8: the attempt died after logging 8, before saving 9."""
    _checkpoint(run_dir, 3)
    _checkpoint(run_dir, 6)
    _log(run_dir, *range(1, 9))


def test_a_passed_trigger_lands_on_the_step_after_the_checkpoint_not_after_the_newest_row(tmp_path):
    run_dir = tmp_path / "run"
    _died_after_logging_step_8(run_dir)
    start = attempt_start(run_dir)
    assert start.resume_step == resume_step(run_dir) == 6
    external, planted_rollout, planted_trainer = (Fault("sigkill", 5, 1), Fault("prm_exception", 5, chaos.ROLLOUT_RANK),
                                                  Fault("save_kill", 5, 0))
    assert trigger_now(external, start.resume_step, LEAD, chaos.ROLLOUT_RANK) == 7
    assert trigger_now(planted_rollout, start.resume_step, LEAD, chaos.ROLLOUT_RANK) == 7 + LEAD
    assert trigger_now(planted_trainer, start.resume_step, LEAD, chaos.ROLLOUT_RANK) == 7
    assert trigger_now(Fault("sigkill", 11, 1), start.resume_step, LEAD, chaos.ROLLOUT_RANK) == 11  # not passed yet
    assert trigger_now(Fault("resume_kill", None, 0), start.resume_step, LEAD, chaos.ROLLOUT_RANK) is None
    # What the sweep did before: counted from the newest row (8), the fault went in at step 9, two steps late.
    newest_row = max(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert trigger_now(external, newest_row, LEAD, chaos.ROLLOUT_RANK) == 9 != 7


def test_an_altered_newest_checkpoint_is_passed_over_as_the_resume_passes_it_over(tmp_path):
    run_dir = tmp_path / "run"
    _died_after_logging_step_8(run_dir)
    distcp = run_dir / "checkpoints" / "step_000006" / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[512] ^= 0xFF  # same size: only its checksum tells
    distcp.write_bytes(bytes(data))
    start = attempt_start(run_dir)
    assert start.resume_step == 3 and json.loads(start.stale)["step"] == 4
    assert trigger_now(Fault("sigstop", 2, 0), start.resume_step, LEAD, chaos.ROLLOUT_RANK) == 4


def test_a_run_folder_without_checkpoints_or_rows_starts_at_step_zero(tmp_path):
    start = attempt_start(tmp_path / "run")
    assert (start.resume_step, start.stale) == (0, None)
    assert step_reached(tmp_path / "run", start) == 0 and attempt_steps(tmp_path / "run", start) == []


def test_only_the_rows_this_attempt_logged_say_which_step_it_reached(tmp_path):
    run_dir = tmp_path / "run"
    _died_after_logging_step_8(run_dir)
    start = attempt_start(run_dir)
    assert json.loads(start.stale)["step"] == 7
    # The restart has not dropped the stale rows 7 and 8 yet: a fault waiting for step 7 must wait on.
    assert attempt_steps(run_dir, start) == [] and step_reached(run_dir, start) == 6
    drop_rows_after(run_dir / "metrics.jsonl", 6)  # the resume from step 6, as MetricsLogger starts
    assert attempt_steps(run_dir, start) == [] and step_reached(run_dir, start) == 6
    _log(run_dir, 7, time=9.25)  # the restart's own row of step 7 (its time differs)
    assert attempt_steps(run_dir, start) == [7] and step_reached(run_dir, start) == 7
    # No stale rows (the last attempt died right after its save): every row past the checkpoint is the attempt's.
    _checkpoint(run_dir, 9)
    _log(run_dir, 8, 9, time=9.25)
    clean = attempt_start(run_dir)
    assert (clean.resume_step, clean.stale) == (9, None) and step_reached(run_dir, clean) == 9
    _log(run_dir, 10)
    assert attempt_steps(run_dir, clean) == [10]


def test_the_first_row_of_an_attempt_is_noted_when_it_logs_one_not_at_a_stale_row(tmp_path):
    run_dir = tmp_path / "run"
    _died_after_logging_step_8(run_dir)
    start = attempt_start(run_dir)
    logged_at: list[float] = []

    def log_step_7() -> None:
        logged_at.append(time.time())
        _log(run_dir, 7, time=9.25)

    # The restart, one move per poll: starting, dropping the stale rows, starting its step, logging it.
    moves = iter([lambda: None, lambda: drop_rows_after(run_dir / "metrics.jsonl", 6), lambda: None, log_step_7,
                  lambda: None])

    def ended() -> bool:
        move = next(moves, None)
        if move is None:
            return True
        move()
        return False

    reached, first_row = poll_attempt(run_dir, start, lambda: False, ended)
    assert not reached and logged_at and first_row >= logged_at[0]


def test_a_row_read_while_it_is_being_written_counts_once_its_newline_is_there(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 3)
    _log(run_dir, 1, 2, 3)
    start = attempt_start(run_dir)
    with open(run_dir / "metrics.jsonl", "a") as out:
        out.write('{"step": 4, "time": 1')  # the writer's line, half read
    assert step_reached(run_dir, start) == 3
    with open(run_dir / "metrics.jsonl", "a") as out:
        out.write('2.5, "loss": 0.25}\n')
    assert step_reached(run_dir, start) == 4
