"""Stopping a run early on purpose, with a checkpoint: a signal (preemption, the scheduler's warning before the
time limit) or the job's time limit approaching (``trainer.save_before_seconds``).

Signal handlers only set a flag. At the end of every step all ranks agree on it with one small all-reduce, as
Megatron-LM's exit-signal handler does, so a signal seen by any one rank makes every rank save the same step and
stop; a resumed job continues exactly from there. Under torchrun, only SIGINT / SIGTERM / SIGHUP / SIGQUIT sent to
torchrun reach the workers, and torchrun kills them about 30 s after forwarding SIGTERM: the step in flight and
the save must fit in that window. SIGUSR1 / SIGUSR2 have to be sent to the workers themselves (``srun --signal``
or ``scancel --signal=USR1 --full`` under SLURM). The run harness (``grpo_mega.harness.lifecycle``) uses it for GRPO, SFT
and PRM training alike.

Stopping at once: a second stop signal (any of ``STOP_SIGNALS``, at least ``SECOND_SIGNAL_AFTER_S`` after the
first: sooner, it is the same signal delivered twice), or ``trainer.stop_grace_s`` passing after the first while the step
in flight has not ended, calls the ``stop_now`` the harness gave: the run ends there, without saving the step in
flight, and resumes from its last checkpoint. Its exit status is 128 + the signal's number (143 for SIGTERM), what a
shell reports for a process that signal ended: not 3, which promises a checkpoint of the step in flight, and not 0 or
1, so neither ``--dependency=afterok`` nor a "failed, do not retry" rule fires.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from grpo_mega.run.failure import note_signal

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
SECOND_SIGNAL_AFTER_S = 5.0
"""A stop signal sooner than this after the first is the same one delivered twice: SLURM signals every process of a
step and torchrun forwards the signal to its ranks, a ``kill`` of a process group reaches a command and its work,
which the command forwards it to. A person's second one comes later. (Longer than Ctrl-C's ``REPEAT_WINDOW_S``:
taking a copy for a second signal here would lose the step in flight and its save.)"""
EXIT_STOPPED_EARLY = 3
"""Exit status of a run that stopped before ``trainer.total_steps`` after saving a checkpoint (not 0, so a
``--dependency=afterok`` chain does not start the next stage)."""


class StoppedEarly(Exception):
    """The run saved a checkpoint and stopped before its last step; the same command resumes it."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"stopped after step {step} ({reason}); a checkpoint of step {step} was saved: run the same "
                         "command again to resume")
        self.step, self.reason = step, reason


class StoppedWithTheRun(StoppedEarly):
    """This rank ended because the ranks that decide stopped the run early (the rollout world, told ``stop`` by the
    trainer before the last step): the same exit status as theirs, :data:`EXIT_STOPPED_EARLY`, and no line of its
    own (they say why). Not status 0: a rank forked by torchrun's agent that returns 0 waits for the agent to read
    its return value, which an agent shutting the job down on a SIGTERM never does; it SIGKILLed the rollout rank 30
    s later (every preemption of an async run on CPU torch: 31.7 s from the SIGTERM to the exit, 4.7 s after)."""


def job_end_time(environ=os.environ) -> float | None:
    """The UNIX time the job must end: ``SLURM_JOB_END_TIME`` under SLURM, else None."""
    value = environ.get("SLURM_JOB_END_TIME")
    return float(value) if value else None


def run_end_time(time_limit_seconds: float, environ=os.environ) -> float | None:
    """When a run must end: ``time_limit_seconds`` from now when set (> 0), else the SLURM job's end, else never."""
    if time_limit_seconds:
        return time.time() + time_limit_seconds
    return job_end_time(environ)


def exit_status_stopped_now(signum: int) -> int:
    """The exit status of a run ended at once by stop signal ``signum``: 128 + its number, as a shell reports it."""
    return 128 + int(signum)


class StopRequests:
    """Collects reasons to stop early; :meth:`agreed_reason` is collective (call it once per step on every rank).

    Args:
        save_before_seconds: stop (and save) once the time left before ``end_time`` is below this; 0 disables.
        end_time: UNIX time the job ends (``time_limit_seconds`` after start, else the SLURM job's end).
        stop_now: ``stop_now(reason, signum)`` ends the process at once (it does not return); called on a second
            stop signal, or ``grace_s`` after the first while the step in flight has not ended (see the module
            docstring). None: repeats change nothing (the rollout worker's, whose trainer decides).
        grace_s: ``trainer.stop_grace_s``; 0: the step in flight may take as long as it takes.
    """

    _REASONS = ("", "signal", "time limit")

    def __init__(self, *, save_before_seconds: float = 0.0, end_time: float | None = None,
                 stop_now: Callable[[str, int], None] | None = None, grace_s: float = 0.0):
        self.save_before_seconds = save_before_seconds
        self.end_time = end_time
        self.signal_name: str | None = None
        self.stop_now = stop_now
        self.grace_s = grace_s
        self._first: tuple[int, float] | None = None  # (signal number, monotonic time) of this rank's first signal
        self._grace_timer: threading.Timer | None = None
        self._previous = {}

    def install(self) -> "StopRequests":
        """Catch ``STOP_SIGNALS`` in this process (main thread) until :meth:`uninstall`."""
        note_signal(None)  # a new run: a signal an earlier run of this process received is not this one's
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        self.step_ended()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        note_signal(None)

    def step_ended(self) -> None:
        """The step in flight has ended (the harness saves it next): ``grace_s`` no longer runs."""
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._first is not None and self.stop_now is not None:
            if now - self._first[1] >= SECOND_SIGNAL_AFTER_S:  # sooner: the same signal delivered twice
                self.stop_now(f"a second stop signal ({name})", signum)
            return
        self.signal_name = name
        note_signal(name)
        self._first = (signum, now)
        if self.grace_s > 0 and self.stop_now is not None:
            self._grace_timer = threading.Timer(self.grace_s, self._grace_over)
            self._grace_timer.daemon = True
            self._grace_timer.start()

    def _grace_over(self) -> None:
        self.stop_now(f"the step in flight did not end within trainer.stop_grace_s={self.grace_s:g} s of "
                      f"{self.signal_name}", self._first[0])

    def _local_code(self) -> int:
        if self.signal_name is not None:
            return 1
        if self.save_before_seconds and self.end_time is not None:
            if self.end_time - time.time() < self.save_before_seconds:
                return 2
        return 0

    def agreed_reason(self, device: torch.device) -> str | None:
        """The reason to stop now, the same on every rank (a signal on any rank counts), or None."""
        code = torch.tensor([self._local_code()], dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        if code.item() == 0:
            return None
        if code.item() == 1:
            return f"{self.signal_name} received" if self.signal_name else "a signal on another rank"
        return f"less than trainer.save_before_seconds={self.save_before_seconds:g} s left before the time limit"
