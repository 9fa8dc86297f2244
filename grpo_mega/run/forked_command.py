"""A command's work run in a process forked from an offered shared fork server (CPU builds of torch).

A ``grpo-mega`` command that does its work in its own process (``train`` / ``sft`` / ``eval`` on one process,
``prm train | label | score | eval``) imports torch, megatron-core and transformers first: 5-6 s of CPU on the 2-core
test machine; one on ``--nproc N`` execs torchrun, a new interpreter that imports torch again for its agent (~2 s).
Every such command a pipeline starts pays it (the test suite starts about two hundred). Where a shared server is
offered (``grpo_mega.run.shared_fork_server``: the test suite's), the command hands its work to a process forked from
that server, which has them imported already: :func:`run_forked` starts it and waits, and the command's own process
stays what its caller sees (only a command line's process hands off: ``grpo_mega.cli.main(argv)`` called from Python
does its work where it is called). On ``--nproc N`` the forked process becomes torchrun's agent in place of the exec
(``grpo_mega.run.torchrun.relaunch_with_torchrun``), and forks the ranks from the same server:

- the forked process runs the command as ``python -m grpo_mega.cli ARGS`` would, with this process's environment,
  working directory, ``sys.path``, standard input, output and error (``LauncherSide`` and multiprocessing's
  preparation data), in a session and process group of its own (its helpers are its group's, as a rank's are);
- the stop signals this process gets (Ctrl-C, a scheduler's SIGTERM / SIGUSR1, SIGHUP) are passed on to it, and its
  exit status becomes this process's (a death by a signal, too: this process then dies by the same signal);
- it ends itself (SIGKILL) as soon as it finds this process gone (a SIGKILL to the command), so a one-process
  command leaves no orphan writing to the run folder; on ``--nproc N`` its ranks then end too, as they do with any
  launcher of theirs (``grpo_mega.run.lifeline``, ``grpo_mega.run.forked_ranks``).

Nothing changes without an offer, under a launcher (torchrun's or srun's ranks) or under SLURM. Tests that find a
command's processes through its process tree start it without the offer (``shared_fork_server.without_offer``).
"""

from __future__ import annotations

import io
import os
import signal
import sys

from grpo_mega.perf.startup import COMMAND_START_ENV, process_start_time
from grpo_mega.run.module_main import end_by_sigint, run_module_as_main
from grpo_mega.run.shared_fork_server import LauncherSide, is_open_fd

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
"""The signals a command's process passes on to the process that runs its work."""

PARENT_POLL_S = 0.1
"""How often the forked process checks that the command's process is still there."""

_forked = False
"""True in a process started by :func:`run_forked` (its command runs here and must not hand off again)."""


def in_forked_command() -> bool:
    """Whether this process runs a command's work for the command's process (started by :func:`run_forked`)."""
    return _forked


def can_run_forked() -> bool:
    """Whether this command's work can go to a process forked from an offered shared server: one is offered and
    usable here (not under SLURM), this process is not a rank of a launched job nor itself such a forked process, and
    ranks are forked at all on this machine (a CPU build of torch)."""
    from grpo_mega.run.forked_ranks import forking_allowed
    from grpo_mega.run.launcher import under_launcher
    from grpo_mega.run.shared_fork_server import is_offered

    return not _forked and not under_launcher() and is_offered() and forking_allowed()


def run_forked(module: str, argv: list[str]) -> int:
    """Run ``python -m module *argv``'s work in a process forked from the offered server (see the module's
    docstring) and wait for it; its exit status. Call only where :func:`can_run_forked` is True."""
    import multiprocessing

    from grpo_mega.run.launcher import fork_from_a_preloaded_server

    if not fork_from_a_preloaded_server():
        raise RuntimeError("run_forked: no shared fork server is offered")
    os.environ.setdefault(COMMAND_START_ENV, repr(process_start_time()))  # the ranks' "launch" counts from here
    process = multiprocessing.get_context("forkserver").Process(
        target=_run_command, args=(LauncherSide(standard_input=True), module, argv), name="grpo-mega-command")
    pending: list[int] = []  # signals that came before the process had a pid

    def forward(signum, _frame):
        if process.pid is None:
            pending.append(signum)
        else:
            _send(process.pid, signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        process.start()
        for signum in pending:
            _send(process.pid, signum)
        process.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    code = process.exitcode
    if code is not None and code < 0:  # killed by a signal: so is this process, as it would have been
        sys.stdout.flush()
        sys.stderr.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose disposition cannot be set (nor caught)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return 1 if code is None else code


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _run_command(launcher: int, module: str, argv: list[str]) -> None:
    """The forked process: ``python -m module *argv`` with the command's environment and standard streams (adopted
    when ``launcher``, a ``LauncherSide``, was unpickled), ended by SIGKILL once the command's process ``launcher``
    is gone."""
    global _forked
    _forked = True
    os.setsid()
    _fresh_standard_streams()
    _end_with(launcher)
    code, interrupted = run_module_as_main(module, argv)
    if interrupted:
        end_by_sigint()
    raise SystemExit(code)


def _fresh_standard_streams() -> None:
    """``sys.stdin`` / ``stdout`` / ``stderr`` over descriptors 0-2 as an interpreter started on them sets them up
    (line-buffered output on a terminal, stderr always), not as the server's were."""
    def text(fd: int, mode: str, line_buffering: bool, errors: str):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line_buffering)

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if is_open_fd(0):
        sys.stdin = text(0, "r", False, "strict")
    sys.stdout = text(1, "w", os.isatty(1), "strict")
    sys.stderr = text(2, "w", True, "backslashreplace")


def _end_with(launcher: int) -> None:
    """SIGKILL this process (its group's helpers are its reaper's) once the process ``launcher`` is gone."""
    import threading
    import time

    from grpo_mega.run.procfs import alive

    def watch() -> None:
        while alive(launcher):
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="grpo-command-watch", daemon=True).start()
