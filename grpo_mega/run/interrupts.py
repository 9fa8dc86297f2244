"""Ctrl-C (SIGINT) stops every ``grpo-mega`` process, in every window of its life, with one line and exit 130.

Why a handler of our own: a process that starts with SIGINT *ignored* keeps ignoring it, and so do its children.
A shell without job control starts its background jobs that way (``cmd &`` in a script, many CI runners), and
Python then does not install its KeyboardInterrupt handler: ``grpo-mega quickstart`` started so ran to the end after
a SIGINT to its process group (the fresh-clone CI failure of ``test_ctrl_c_on_quickstart_is_one_line_and_exit_130``),
or ended with exit 1 when only torchrun, which installs its own handler, saw it. :func:`catch_ctrl_c` (the first
call of the CLI and of the launcher) installs the handler whatever the process inherited; a child started after it
inherits SIGINT at its default again (exec resets a caught signal), so it stops from its first instruction.

Windows the clock found between those (``bench/ctrl_c_sweep.py``, issue 79), each closed where it opens: the CLI
module's imports and the parse of the command line (SIGINT held blocked from the module's first line, then inside
main's ``try``: :func:`hold_ctrl_c_in_a_commands_start`); the exec from the command to torchrun
(:func:`exec_holding_ctrl_c`: blocked across it, raised by the launcher's first call, not dropped with the old
image); torch's import (:func:`import_torch_holding_ctrl_c`: torch's C extension swallows what its numpy import
raises, so a KeyboardInterrupt there was lost). Only the interpreter's own start, before any code of ours runs
(~0.3 s), is left to Python's default handler.

One Ctrl-C reaches a job several times: the terminal sends it to the whole process group, then the pipeline
forwards it to its command and torchrun to its ranks. The first raises KeyboardInterrupt; repeats within
:data:`REPEAT_WINDOW_S` are the same Ctrl-C and are let pass, so the clean-up (the failure record, the one line)
is not itself interrupted; a Ctrl-C after that raises KeyboardInterrupt again (a user pressing it twice).

:func:`pause_point` is how the tests put a signal in a given window deterministically: a process reaching a named
point (``GRPO_MEGA_PAUSE_AT``) writes a marker file and waits there for the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

EXIT_INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)."""
REPEAT_WINDOW_S = 2.0
"""SIGINTs within this many seconds of the first are copies of the same Ctrl-C (forwarded by a parent)."""
PAUSE_AT_ENV = "GRPO_MEGA_PAUSE_AT"
"""Test hook: comma-separated names of :func:`pause_point` calls at which this process waits."""
PAUSE_DIR_ENV = "GRPO_MEGA_PAUSE_DIR"
"""Test hook: the folder where a paused process writes its marker ``<name>.<pid>`` (default: the working one)."""
PAUSE_S = 120.0
"""How long a paused process waits for its signal before it goes on."""

_first_sigint: float | None = None


def _on_sigint(signum, frame) -> None:
    global _first_sigint
    now = time.monotonic()
    if _first_sigint is not None and now - _first_sigint < REPEAT_WINDOW_S:
        return  # the same Ctrl-C again, forwarded by a parent: the clean-up of the first goes on
    _first_sigint = now
    raise KeyboardInterrupt


def catch_ctrl_c() -> None:
    """Make SIGINT raise KeyboardInterrupt in this process (main thread only), even when it started ignored or
    blocked: a Ctrl-C held blocked across an exec (:func:`exec_holding_ctrl_c`) is raised here. Call it inside the
    ``try`` that turns KeyboardInterrupt into the command's one line."""
    global _first_sigint
    if threading.current_thread() is threading.main_thread():
        _first_sigint = None
        signal.signal(signal.SIGINT, _on_sigint)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


COMMAND_SCRIPT = "grpo-mega"
"""The console script that runs ``grpo_mega.cli.main``."""


def hold_ctrl_c_in_a_commands_start(module_name: str) -> None:
    """At the top of the CLI module (``module_name``: its ``__name__``) in the process a command line started
    (``python -m grpo_mega.cli``, the ``grpo-mega`` script, a rank that runs the module): block SIGINT until main's
    :func:`catch_ctrl_c`, inside its ``try``, so that a Ctrl-C while the module imports its own (0.6 s under load)
    ends in the command's one line, not in a KeyboardInterrupt traceback (the interpreter's start before this, ~0.3
    s, stays Python's). Nothing where the module is imported by another program (main(argv) called from Python)."""
    if module_name == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == COMMAND_SCRIPT:
        if threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            pause_point("cli.import")  # tests: a Ctrl-C while the CLI imports (it waits until one is pending)


def end_interrupted() -> None:
    """End this process, a command's own interpreter whose Ctrl-C line is said, with :data:`EXIT_INTERRUPTED`: the
    exit functions run (the fork server's end, multiprocessing's clean-up) with a further Ctrl-C ignored, the
    standard streams are flushed, and the interpreter's finalization is skipped. Why: after a KeyboardInterrupt
    raised in the middle of the imports (the CLI's own, torch's), the finalization could still end the process by
    a signal: killed by SIGINT (-2) just after its line in 3 of 15 Ctrl-Cs at 0.5-1.5 s (bench/ctrl_c_sweep.py,
    issue 79; the mechanism inside the interpreter not identified), aborted (-6) after an interrupted torch
    import."""
    import atexit

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command has said how it ended: a second Ctrl-C changes nothing
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_INTERRUPTED)


def is_a_programs_own_process() -> bool:
    """Whether this process is an interpreter a command line started (not one multiprocessing forked or spawned:
    a rank, a command's work forked from a server), whose exit :func:`end_interrupted` may take in hand."""
    import multiprocessing

    return multiprocessing.parent_process() is None


def exec_holding_ctrl_c(path: str, argv: list[str], env: dict[str, str]) -> None:
    """``os.execve(path, argv, env)`` with SIGINT blocked across it, for a program that calls :func:`catch_ctrl_c`
    first (``python -m grpo_mega.run.torchrun``). Without it a Ctrl-C in the hand-off was lost or broke the promise:
    one that Python's C handler took just before the exec was dropped with the old image (its KeyboardInterrupt
    never raised: the run trained to its end, exit 0), and one during the new interpreter's start (SIG_DFL, then
    Python's default handler during ``site`` and the module's imports) killed it or printed a traceback. Blocked,
    it stays pending in the kernel across the exec until :func:`catch_ctrl_c` unblocks it inside its ``try``. A
    Ctrl-C that came before the block raises KeyboardInterrupt here (``pthread_sigmask`` checks for one); the mask
    is restored when the exec fails."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:  # the block inside: pthread_sigmask raises the KeyboardInterrupt of a Ctrl-C taken before it, once set
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pause_point("launcher.exec")  # tests: a Ctrl-C in the hand-off (it waits until the SIGINT is pending)
        os.execve(path, argv, env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives during the block until its end (then KeyboardInterrupt): for work that must
    finish whole once begun, such as publishing a checkpoint (renames, ``latest``). Main thread only; elsewhere a
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _held
    held_before, _held = _held, False
    previous = signal.signal(signal.SIGINT, _hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        received, _held = _held, held_before
    if received:
        raise KeyboardInterrupt


_held = False
"""Whether a Ctrl-C arrived during the innermost :func:`ctrl_c_deferred` block."""


def import_torch_holding_ctrl_c() -> None:
    """Import torch (2-5 s under load) with a Ctrl-C held until the import ends, then raised (KeyboardInterrupt, as
    :func:`ctrl_c_deferred` does). Why: torch's C extension imports numpy at its load and takes whatever that import
    raises as "no numpy", so a KeyboardInterrupt raised there was swallowed: the Ctrl-C was lost and the command
    trained to its end with exit 0 (issue 79: the clock's Ctrl-C at 5-6 s, torchrun's agent importing torch; 1 in
    ~15 tries of `import torch` interrupted at random), or numpy stayed half-imported and the next line failed with
    ``AttributeError: module 'numpy' has no attribute 'ndarray'`` (exit 1). Each of our processes that imports torch
    itself (a command working in its own process, once its argument checks passed, which stay torch-free; the
    launcher) calls this first; forked ranks have it preloaded."""
    if "torch" in sys.modules:
        return
    with ctrl_c_deferred():
        pause_point("import.torch")  # tests: a Ctrl-C while torch imports (it waits until one is held)
        import torch  # noqa: F401


def _hold(signum, frame) -> None:
    global _held
    _held = True


def pause_point(name: str) -> None:
    """Test hook: when ``name`` is in ``GRPO_MEGA_PAUSE_AT``, write ``<GRPO_MEGA_PAUSE_DIR>/<name>.<pid>`` and
    wait there (at most :data:`PAUSE_S`; inside :func:`ctrl_c_deferred`, until the Ctrl-C it holds; with SIGINT
    blocked, until one is pending), so that a test sends its signal while this process is at that point. Does
    nothing otherwise (one dictionary look-up)."""
    names = os.environ.get(PAUSE_AT_ENV)
    if not names or name not in names.split(","):
        return
    folder = Path(os.environ.get(PAUSE_DIR_ENV, "."))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.{os.getpid()}").write_text(str(time.time()))
    deadline = time.monotonic() + PAUSE_S
    while time.monotonic() < deadline and not _held and signal.SIGINT not in signal.sigpending():
        time.sleep(0.05)
