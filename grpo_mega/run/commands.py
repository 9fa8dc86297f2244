"""Run one ``grpo-mega`` command as a child process, its output in a log file, and show what it is doing.

The pipelines (``grpo-mega quickstart``, ``prm.pipeline``) run each of their parts as a separate ``grpo-mega``
process, so that every part is also a command a user can run by hand. Their logs go to files; the terminal gets one
live line per command, read from what the command writes as it goes:

- a training command (``sft``, ``prm train``, ``train``) appends one row per step to ``metrics.jsonl``: the line
  shows ``step k/N``, the command's key metric of the latest row that has it, and tqdm's ETA;
- any other command (``prm label``, ``prm eval``) shows the elapsed time and the last line of its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_mega.run.interrupts import pause_point
from grpo_mega.run.lifeline import COMMAND_PARENT_ENV

INTERRUPTED_EXITS = (130, -2)
"""A command's exit status after SIGINT: 130 (its own handler, 128 + SIGINT), -2 (killed by the signal)."""


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The YAML configs shipped with the repository (the quickstart's commands)."""


class CommandFailed(RuntimeError):
    """A command's process exited with a non-zero status; the message ends with the last lines of its log."""


@dataclass(frozen=True)
class CommandProgress:
    """What a command's live line shows."""

    title: str
    """Shown at the left of the line, e.g. "GRPO (outcome)"."""
    metrics_path: Path | None = None
    """The command's ``metrics.jsonl`` (training commands); None: elapsed time and the log's last line instead."""
    total_steps: int | None = None
    """Steps the command runs (the bar's length); None: unknown."""
    metrics: tuple[tuple[str, str], ...] = ()
    """(label, metrics key) pairs shown beside the step, each from the latest row that has the key."""


class MetricsFollower:
    """Reads the rows appended to a ``metrics.jsonl`` since the last call (a half-written last line waits)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0

    def new_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        rows = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


def last_log_line(log_path: Path, width: int = 60) -> str:
    """The last non-empty line of the log (progress bars rewrite a line with carriage returns), shortened."""
    try:
        with log_path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 4096))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    pieces = [piece.strip() for line in tail.splitlines() for piece in line.split("\r")]
    pieces = [piece for piece in pieces if piece]
    text = pieces[-1] if pieces else ""
    return text if len(text) <= width else text[: width - 3] + "..."


def _format_metric(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class _LiveLine:
    """The command's tqdm line; a no-op when ``show`` is False (tests, library use)."""

    def __init__(self, progress: CommandProgress, show: bool):
        self.progress = progress
        self.bar = None
        self.latest: dict[str, object] = {}
        if show:
            from tqdm import tqdm

            # A command without metrics shows elapsed time and its log's last line, not a rate.
            elapsed_only = None if progress.metrics_path else "{desc}: {elapsed} {postfix}"
            self.bar = tqdm(total=progress.total_steps, desc=progress.title, unit="step", bar_format=elapsed_only,
                            dynamic_ncols=True, file=sys.stdout, mininterval=1.0 if sys.stdout.isatty() else 30.0)

    def update_from_rows(self, rows: list[dict]) -> None:
        for row in rows:
            for label, key in self.progress.metrics:
                if key in row:
                    self.latest[label] = _format_metric(row[key])
        steps = [row["step"] for row in rows if isinstance(row.get("step"), int)]
        if self.bar is None or not steps:
            return
        self.bar.update(max(steps) - self.bar.n)
        self.bar.set_postfix(self.latest, refresh=False)

    def update_elapsed(self, seconds: float, log_path: Path) -> None:
        if self.bar is None:
            return
        self.bar.update(int(seconds) - self.bar.n)
        self.bar.set_postfix_str(last_log_line(log_path), refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


STOP_GRACE_S = 60.0
"""How long a command stopped by Ctrl-C (or by its pipeline's error) has to say what it did and end before it is
terminated: torchrun gives its ranks 30 s, and a rank that lost a peer waits a few seconds more before it names it."""


class PipelineTerminated(SystemExit):
    """The pipeline got SIGTERM while a command ran: raised in its main thread so that the command is stopped (and
    waited for) before the pipeline exits, with 128 + SIGTERM."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _raise_terminated(_signum, _frame) -> None:
    raise PipelineTerminated()


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the command's process group (it leads one: its fork server and forked ranks are in it;
    torchrun's ranks, in sessions of their own, die with their agent: ``grpo_mega.run.lifeline``)."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass


def stop_command(child: subprocess.Popen, grace_s: float = STOP_GRACE_S, first: int = signal.SIGINT) -> None:
    """End ``child`` and its process group as Ctrl-C would: ``first`` (SIGINT; SIGTERM when the pipeline got
    SIGTERM, which a training command answers by saving the step in flight), ``grace_s`` to end, then SIGTERM, then
    SIGKILL. Another Ctrl-C or SIGTERM while it waits kills the group at once."""
    if child.poll() is not None:
        return
    try:
        _signal_group(child, first)
        try:
            child.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGTERM)
        try:
            child.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            pass
    except BaseException:  # Ctrl-C or SIGTERM again: no more waiting
        _signal_group(child, signal.SIGKILL)
        child.wait()
        raise
    _signal_group(child, signal.SIGKILL)
    child.wait()


def run_command(argv: list[str], log_path: Path, progress: CommandProgress | None = None, *, show: bool = True,
                poll_seconds: float = 1.0) -> float:
    """Run ``grpo-mega <argv>`` with its output in ``log_path``, showing ``progress`` live; returns wall seconds.

    Raises :class:`CommandFailed` with the log's last lines when the process fails, KeyboardInterrupt when it ended
    from Ctrl-C (exit 130), however the two processes' signals raced. A command resumed from its own
    checkpoints starts its bar at the step it resumes from (the rows it had written before are skipped).

    The command never outlives this process: it leads a process group of its own, stopped (and waited for) when
    this process gets Ctrl-C or SIGTERM (then :class:`PipelineTerminated`, exit 143) or leaves by an error; and the
    kernel kills it when this process dies otherwise, SIGKILL included (``grpo_mega.run.lifeline``). A terminal's
    Ctrl-C reaches the command through this process.
    """
    log_path = Path(log_path)
    progress = progress or CommandProgress(title=argv[0])
    follower = MetricsFollower(progress.metrics_path) if progress.metrics_path else None
    if follower is not None:
        follower.new_rows()  # rows of an earlier, interrupted run of this command
    line = _LiveLine(progress, show)
    start = time.perf_counter()
    pause_point(f"command.{argv[0]}")  # tests: a Ctrl-C between two commands (none running)
    catch_sigterm = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if catch_sigterm else None
    try:
        with log_path.open("w") as log:
            child = subprocess.Popen([sys.executable, "-m", "grpo_mega.cli", *argv], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, COMMAND_PARENT_ENV: str(os.getpid())})
            try:
                while True:
                    try:
                        code = child.wait(timeout=poll_seconds)
                    except subprocess.TimeoutExpired:
                        code = None
                    if follower is not None:
                        line.update_from_rows(follower.new_rows())
                    else:
                        line.update_elapsed(time.perf_counter() - start, log_path)
                    if code is not None:
                        break
            except BaseException as error:
                stop_command(child, first=signal.SIGTERM if isinstance(error, PipelineTerminated) else signal.SIGINT)
                raise
    finally:
        if catch_sigterm:
            signal.signal(signal.SIGTERM, previous_sigterm if previous_sigterm is not None else signal.SIG_DFL)
        line.close()
    if code in INTERRUPTED_EXITS:  # Ctrl-C reached the command's process before this one's KeyboardInterrupt
        raise KeyboardInterrupt(f"'grpo-mega {' '.join(argv[:2])}' was interrupted (exit {code})")
    if code != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise CommandFailed(f"'grpo-mega {' '.join(argv[:2])}' failed (exit {code}); last lines of {log_path}:\n{tail}")
    return time.perf_counter() - start
