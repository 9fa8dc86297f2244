"""What a training run says on rank 0 besides its metrics log: the progress bar (``trainer.progress_bar``) or, with
the bar off, one line per step; and one summary line when the run ends. Each trainer names the figures shown
(label -> metric name: GRPO's score, reward and held-out accuracy; SFT's NLL; the PRM's loss and step accuracy);
a figure missing from a step's row is left out of its line (held-out figures appear on evaluation steps).

    step 3/50  score 0.412  reward 0.380  accuracy 0.625  4.1 s
    grpo-mega train: done, 50/50 steps: score 0.841, reward 0.812, accuracy 0.837; 163 s; last checkpoint
    runs/grpo/checkpoints/step_000050

(the summary is one line; a figure last seen before the last step names its step; the bad rows the prompt loader
skipped, per file, end it).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO


class SkippedRows:
    """The bad rows one run's readers skipped, for its ``done`` line: one entry per read, ``(source, rows skipped,
    the first as file:line: why)``. A read of the same file with the same outcome (every rank, the train and the
    eval file being one file) is one entry; a read with another outcome is another, never a replaced count."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, str]] = []

    def note(self, source: str, count: int, first: str) -> None:
        """Remember that ``count`` rows of ``source`` were skipped (``first``: the first of them)."""
        entry = (str(source), int(count), str(first))
        if entry not in self.reads:
            self.reads.append(entry)

    def merge(self, reads) -> None:
        """Take in another process's reads (``reads`` of its record: the rollout world's, in async mode)."""
        for source, count, first in reads or ():
            self.note(source, count, first)

    def text(self) -> str:
        """``"; skipped 2 bad rows of train.jsonl (the first: train.jsonl:7: ...)"`` per read, or ``""``."""
        return "".join(f"; skipped {count} bad row{'s' if count > 1 else ''} of {source} (the first: {first:.160})"
                       for source, count, first in self.reads)


_RUN_RECORD: list[SkippedRows] = []
"""The record of the run this process is in now (set by :func:`collect_skipped_rows`); empty outside a run, where a
read keeps nothing (its loader still logs its bad rows)."""


def collect_skipped_rows(record: SkippedRows | None) -> None:
    """Make ``record`` the one every read of this process notes its bad rows in from now on (``RunHarness`` at its
    start; the async rollout world), or None: no run, nothing kept (``RunHarness.finish``)."""
    _RUN_RECORD[:] = [record] if record is not None else []


def note_skipped_rows(source: str, count: int, first: str) -> None:
    """Note, in the record of the run this process is in (none: nothing kept), that ``count`` rows of ``source``
    were skipped (``first``: the first of them)."""
    for record in _RUN_RECORD:
        record.note(source, count, first)


def announce_start(command: str, nproc: int, builds: list[str], slow: str = "",
                   then: str = "a line per step follows", out: TextIO | None = None) -> None:
    """Say, once the checks before launch have passed, what a command does before its first line of progress: its
    imports and what it builds (``builds``; ``slow``: what takes longest). That took 20-60 s of silence on a loaded
    2-core machine (measured 2026-12-07: the first line of a 1-step tiny ``train`` came 52-54 s after the command,
    ``sft``'s 44 s, ``prm label``'s 17-20 s; issue 79: a minute with a vLLM PRM scorer). From the command's own
    process, on ``out`` (default: stdout, where the step lines go; stderr stays one line per failure)."""
    processes = f"{nproc} processes" if nproc > 1 else "1 process"
    print(f"{command}: starting on {processes}: importing torch, then building {', '.join(builds)}"
          f"{f' ({slow})' if slow else ''}; {then}", file=out or sys.stdout, flush=True)


_OPEN_BARS: set[StepProgress] = set()
"""The progress bars drawn now (rank 0 of a run), which :func:`close_open_bars` ends before a failure's line."""


def close_open_bars() -> None:
    """End every open progress bar, so that the line printed next (a failure's cause) starts a line of its own."""
    for progress in list(_OPEN_BARS):
        progress.close()


class StepProgress:
    """The progress of steps ``start_step + 1 .. total_steps``: a tqdm bar with the shown figures when ``bar``,
    else a line per logged row on ``out``; keeps each figure's latest value for :meth:`summary`."""

    def __init__(self, *, total_steps: int, start_step: int, shown: Mapping[str, str], bar: bool,
                 out: TextIO | None = None):
        self.total_steps = total_steps
        self.start_step = start_step
        self.shown = dict(shown)
        self.out = out
        self.latest: dict[str, tuple[int, float]] = {}
        """label -> (step, value) of its latest finite value."""
        self.step = start_step
        self.bar = None
        self._last_line = time.perf_counter()
        self._redirect = None
        if bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            # log lines (a checkpoint saved) above the bar, not glued to it with the bar drawn again after them
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            _OPEN_BARS.add(self)

    def record(self, step: int, metrics: Mapping[str, float], *, advance: bool = True) -> None:
        """A logged row: ``advance=False`` for a row that is no training step (the evaluation before the first)."""
        seen = {label: metrics[name] for label, name in self.shown.items()
                if name in metrics and math.isfinite(metrics[name])}
        for label, value in seen.items():
            self.latest[label] = (step, value)
        if advance:
            self.step = step
        if self.bar is not None:
            if advance:
                self.bar.update(1)
            if self.latest:
                self.bar.set_postfix({label: f"{self.latest[label][1]:.3f}" for label in self.shown
                                      if label in self.latest})
            return
        now = time.perf_counter()
        figures = "".join(f"  {label} {value:.3f}" for label, value in seen.items())
        where = f"step {step}/{self.total_steps}" + ("" if advance else " (before training)")
        print(f"{where}{figures}  {now - self._last_line:.1f} s", file=self.out or sys.stdout, flush=True)
        self._last_line = now

    def close(self) -> None:
        """End the bar (once): its last state stays on its own line; logging goes to the console again."""
        if self.bar is not None:
            self._redirect.__exit__(None, None, None)
            self.bar.close()
            self.bar = None
            _OPEN_BARS.discard(self)

    def summary(self, command: str, *, wall_seconds: float, checkpoint: Path | None,
                stop_reason: str | None = None, skipped_rows: SkippedRows | None = None) -> str:
        """One line: how the run ended, the steps done, each figure's latest value (with its step when that was
        not the last), the wall seconds, the newest checkpoint and the run's skipped bad rows."""
        ended = f"stopped early ({stop_reason})" if stop_reason else "done"
        steps = f"{self.step}/{self.total_steps} steps"
        if self.start_step:
            steps += f" (resumed after step {self.start_step})"
        latest = [(label, *self.latest[label]) for label in self.shown if label in self.latest]  # in shown order
        figures = ", ".join(f"{label} {value:.3f}" + ("" if at == self.step else f" (step {at})")
                            for label, at, value in latest)
        where = f"last checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
        return (f"{command}: {ended}, {steps}{': ' + figures if figures else ''}; {wall_seconds:.0f} s; {where}"
                f"{skipped_rows.text() if skipped_rows is not None else ''}")


class PhaseProgress:
    """The progress lines of a command that works for minutes outside a training loop (``grpo-mega eval``, ``prm
    label``): a line when a phase starts, then at most one every ``every_s`` seconds as its items are done, on rank
    0 (``speaks``)::

        grpo-mega eval: sample 1/1: generating 200 prompts
        grpo-mega eval: sample 1/1: 128/200 prompts, 61 s

    Called as ``progress(done, total)`` (the hf rollout engine's ``on_progress``)."""

    def __init__(self, command: str, *, every_s: float = 10.0, speaks: bool = True, out: TextIO | None = None):
        self.command, self.every_s, self.speaks, self.out = command, every_s, speaks, out
        self.phase, self.unit = "", "items"
        self._started = self._last = time.perf_counter()

    def start(self, phase: str, total: int | None = None, unit: str = "items") -> None:
        """A new phase, of ``total`` ``unit`` when given (one line)."""
        self.phase, self.unit = phase, unit
        self._started = self._last = time.perf_counter()
        self._say(phase if total is None else f"{phase}: {total} {unit}")

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self._last >= self.every_s and done < total:
            self._last = now
            self._say(f"{self.phase}: {done}/{total} {self.unit}, {now - self._started:.0f} s")

    def finish(self, what: str) -> None:
        """The phase's end (one line, with its seconds)."""
        self._say(f"{self.phase}: {what}, {time.perf_counter() - self._started:.0f} s")

    def _say(self, text: str) -> None:
        if self.speaks:
            print(f"{self.command}: {text}", file=self.out or sys.stderr, flush=True)
