"""A deadline for the phases no collective timeout bounds: the weight sync to the rollout engine, the vLLM wake /
sleep, PRM scoring, the checkpoint save (``grpo_mega.run.failure.phase(name, bounded=True)``).

A collective that waits for a hung peer raises after ``trainer.collective_timeout_s``; a rank hung on its own (a
vLLM wake-up that never returns, a checkpoint writer stuck on a dead file server, a PRM forward in a deadlock) waits
in no collective, and its peers, waiting for it in the next one, would name the wrong rank and phase. The watchdog
is one daemon thread: when a bounded phase runs past its deadline (``timeout_s`` for a phase the rank runs alone,
plus :func:`peer_grace_s` for one with collectives, so that a rank waiting there for a hung peer is not the one
named) it records the failure (cause
``phase_timeout``, the phase, the step) in ``run_dir/failure.json`` and on stderr, prints every thread's stack
(``faulthandler``), and ends the process with :data:`EXIT_PHASE_TIMEOUT`; torchrun then ends the other ranks.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import sys
import threading
import time
from pathlib import Path

from grpo_mega.run.failure import POSITION, PhaseTimeout, failure_line, record_failure, set_watchdog

EXIT_PHASE_TIMEOUT = 124
"""Exit status of a process the watchdog ended (as timeout(1)'s)."""


def peer_grace_s(timeout_s: float) -> float:
    """How much longer than the timeout a phase with collectives may run: a quarter of it, 5 to 60 s."""
    return min(60.0, max(5.0, 0.25 * timeout_s))


class PhaseWatchdog:
    """Ends the process when a bounded phase runs past ``timeout_s`` (see the module docstring). ``install()``
    makes it the one :func:`grpo_mega.run.failure.phase` arms; ``close()`` stops watching."""

    def __init__(self, run_dir: str | Path, timeout_s: float, *, command: str = "grpo-mega", setting: str = ""):
        self.run_dir = Path(run_dir)
        self.timeout_s = float(timeout_s)
        self.command = command
        self.setting = setting or f"{self.timeout_s:g} s"
        self._armed: dict[int, tuple[str, float]] = {}
        self._tokens = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="grpo-mega-phase-watchdog", daemon=True)

    def install(self) -> "PhaseWatchdog":
        self._thread.start()
        set_watchdog(self)
        return self

    def close(self) -> None:
        set_watchdog(None)
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def arm(self, name: str, *, alone: bool = False) -> int:
        """Start the deadline of phase ``name``: the timeout when the rank runs it ``alone``, else the timeout plus
        :func:`peer_grace_s` (the phase has collectives: a rank waiting there for a hung peer lets the collective
        timeout, and the hung peer's own deadline, name the cause). Returns the token to :meth:`disarm` it with."""
        with self._changed:
            token = next(self._tokens)
            seconds = self.timeout_s if alone else self.timeout_s + peer_grace_s(self.timeout_s)
            self._armed[token] = (name, time.monotonic() + seconds)
            self._changed.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._changed:
            self._armed.pop(token, None)
            self._changed.notify()

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if not self._armed:
                    self._changed.wait()
                    continue
                name, deadline = min(self._armed.values(), key=lambda armed: armed[1])
                left = deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(timeout=left)
                    continue
                break
            else:
                return
        self._expire(name)

    def _expire(self, name: str) -> None:
        """Record the failure in the phase the rank is in now (the innermost, which may be inside ``name``)."""
        inner = POSITION["phase"]
        within = f" (in {inner!r})" if inner != name else ""
        error = PhaseTimeout(f"phase {name!r} ran past {self.setting}{within}; every thread's stack follows")
        record, path = record_failure(self.run_dir, error, in_phase=inner)
        print(failure_line(self.command, record, path), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_PHASE_TIMEOUT)
