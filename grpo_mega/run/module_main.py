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
    the ``atexit`` handlers run, the standard streams are flushed. Returns (the exit status, a ``SystemExit``'s
    code as given; whether an uncaught Ctrl-C ended the module, see :func:`end_by_sigint`)."""
    import runpy

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
