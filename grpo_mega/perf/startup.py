"""Where a training process's start-up goes: seconds from the process's own start to its first training step, by
phase, logged as ``startup_s/<phase>`` in the first step's metrics row of each process (a resumed run logs its own).

The phases are marked in the order they happen (:meth:`StartupClock.mark`); each counts the seconds since the mark
before it, the first since the process started (read from ``/proc``, so the interpreter's start and every import
the command made before the clock existed are in it). The run harness marks ``imports`` (the process start to the
harness: Python, torch, megatron-core, transformers and the config), ``distributed`` (process groups, the first
collective) and ``load`` (resume or initial weights); a trainer marks its own (GRPO: ``data``, ``model_build``,
``rollout_engine``); whatever runs between the last mark and the first step is ``other``. ``bench/startup.py``
reads these rows per command.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_start_time() -> float:
    """The wall-clock time (epoch seconds) this process started, from ``/proc``: its start in clock ticks after boot
    (``/proc/self/stat`` field 22) against the seconds since boot now (``/proc/uptime``), to the tick (10 ms).
    Without ``/proc``: now."""
    try:
        ticks_after_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        seconds_since_boot = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (seconds_since_boot - ticks_after_boot / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


COMMAND_START_ENV = "GRPO_MEGA_COMMAND_START"
"""Set by the launcher (``grpo_mega.run.torchrun.relaunch_with_torchrun``) to the start of the user's command, so a rank
counts the seconds before its own process started (the command's imports, torchrun's, its rendezvous) as
``launch``."""


class StartupClock:
    """Seconds per start-up phase, from the process start (from the user's command when the launcher says when it
    started: the ``launch`` phase); a phase marked twice adds up."""

    def __init__(self, start: float | None = None):
        self.start = process_start_time() if start is None else start
        self._last = self.start
        self.seconds: dict[str, float] = {}
        self.done = False
        # taken out of the environment, so a command this process starts does not count from the same start
        launched_at = os.environ.pop(COMMAND_START_ENV, "")
        try:
            command_start = float(launched_at)
        except ValueError:
            return
        if command_start <= self.start:
            self.seconds["launch"] = self.start - command_start

    def mark(self, phase: str) -> None:
        """The seconds since the previous mark (the process start for the first) went to ``phase``; nothing once
        :meth:`finish` ran."""
        if self.done:
            return
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = now

    def finish(self) -> dict[str, float]:
        """The metrics once, at the first step: every phase, ``other`` for the time since the last mark, and
        ``total``; an empty dict afterwards."""
        if self.done:
            return {}
        self.mark("other")
        self.done = True
        metrics = {f"startup_s/{phase}": seconds for phase, seconds in self.seconds.items()}
        metrics["startup_s/total"] = sum(self.seconds.values())
        return metrics
