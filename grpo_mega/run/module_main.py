"""A module run as ``python -m`` runs it, in a process forked from a preloaded server (a rank,
``grpo_mega.run.forked_ranks``; a command's work, ``grpo_mega.run.forked_command``): the interpreter's own ending of
a ``-m`` run done by hand, since such a process ends with ``os._exit`` (multiprocessing's), not as an interpreter."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import traceback


def run_module_as_main(module: str, arguments: list[str] | tuple[str, ...]) -> tuple[object, bool]:
    """Run ``module`` as ``__main__`` with ``sys.argv`` = its file and ``arguments`` (``runpy``), after setting
    torch's intra-op threads from ``OMP_NUM_THREADS`` (OpenMP read it when the server imported torch, not from this
    process's environment). As the interpreter does: an uncaught exception prints its traceback (exit status 1),
    the ``atexit`` handlers run (not the server's ``weakref.finalize`` callbacks: :func:`_leave_the_server_s_finalizers`),
    the standard streams are flushed. Returns (the exit status, a ``SystemExit``'s
    code as given; whether an uncaught Ctrl-C ended the module, see :func:`end_by_sigint`)."""
    import runpy

    _leave_the_server_s_finalizers()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *arguments]  # runpy puts the module's file in sys.argv[0]
    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - as the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    flush_standard_streams()
    return code, interrupted


def _leave_the_server_s_finalizers() -> None:
    """Keep the ``weakref.finalize`` callbacks this process inherited from its fork server from running at its exit:
    they are the server's, for objects its preload made. torch's ~190 operator libraries were deregistered in every
    forked process (0.04 s of CPU each, 3 processes a command, 2026-12-08), and wandb's two temporary folders were
    deleted under the server, and under every other process forked from it, by the first forked process to end.
    The module's own finalizers, registered from here on, run."""
    import weakref

    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False


def exit_without_teardown(code: int) -> None:
    """End this process with exit status ``code`` as the interpreter ends a program, less the teardown of its
    modules and objects: the non-daemon threads are joined, the ``atexit`` handlers run (logging's, multiprocessing's
    finalizers, the fork server's end, ``weakref.finalize``'s), the standard streams are flushed, then ``os._exit``,
    as every process multiprocessing forks ends. For a process with torch imported whose work is done: freeing
    torch's modules is 0.4-0.6 s of CPU (torchrun's agent, ``grpo_mega.run.torchrun``), 1.7 s with megatron-core and
    transformers too (2-core machine, 2026-12-08); nothing of it is seen outside the process."""
    import threading

    try:
        threading._shutdown()  # the interpreter's first step at exit: wait for the non-daemon threads
        atexit._run_exitfuncs()
    finally:
        flush_standard_streams()
        os._exit(code)


def end_without_torch_s_teardown(code: int) -> None:
    """In a command line's own process whose work, done, imported torch (``grpo-mega`` on one process, or a rank
    torchrun started as an interpreter): :func:`exit_without_teardown` with ``code``, as a rank forked from a server
    ends (the teardown of torch, megatron-core and transformers: 1.7 s of CPU on the 2-core machine, 2026-12-08).
    Nothing elsewhere: a process multiprocessing started ends as it does, a light command as the interpreter does."""
    from grpo_mega.run.interrupts import is_a_programs_own_process

    if is_a_programs_own_process() and "torch" in sys.modules:
        exit_without_teardown(code)


def end_by_sigint() -> None:
    """End this process as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
