"""torchrun's ranks forked from a preloaded server instead of started as new interpreters (CPU builds of torch).

torchrun starts each rank of ``-m grpo_mega.cli ...`` as ``python -u -m grpo_mega.cli ...``, and every rank then
imports torch, megatron-core and transformers: 5-7 s of CPU per rank on a 2-core machine, where a 2-process command
pays it twice and the test suite starts hundreds of ranks. ``grpo_mega.run.torchrun`` hands torchrun's agent
:func:`run_rank` as a function entrypoint instead (the ``forkserver`` start method, the server preloading
``grpo_mega.run.launcher.PRELOADED`` once per command), which runs the module exactly as ``python -u -m`` would:

- the module runs as ``__main__`` with ``sys.argv`` = its file and the arguments (``runpy``), its exit status is the
  process's, an uncaught exception prints its traceback and exits 1, an uncaught Ctrl-C ends by SIGINT, and the
  ``atexit`` handlers run (multiprocessing's children would otherwise skip them; not the ``weakref.finalize``
  callbacks of the server's own objects, ``grpo_mega.run.module_main``);
- the rank leads a session and process group of its own (torchrun's ranks do: ``start_new_session``), so a
  terminal's Ctrl-C reaches the agent, which forwards it, and ``grpo_mega.run.reaper`` finds the rank's helpers;
- it ends with its launcher, however the launcher ends (``grpo_mega.run.lifeline``: SIGKILL on the death of its
  fork server, which dies with the launcher; where the server is a shared one, a watch on the launcher's pid),
  not with torch's multiprocessing wrapper's SIGINT on the server's death (read as a user's Ctrl-C);
- its standard streams are unbuffered (``-u``), so a log shows each line as the rank writes it;
- torch's intra-op threads are set from ``OMP_NUM_THREADS`` (OpenMP read it when the server loaded it).

- it is named ``grpo-rank-<RANK>`` (``/proc/<pid>/comm``: ``ps -o pid,comm``, ``pgrep grpo-rank``);
- its ``startup_s/launch`` (``grpo_mega.perf.startup``: until the rank's process started) holds the server's
  preload, and its ``startup_s/imports`` only what the module imports beyond it.

What differs from torchrun's own ranks: ``ps`` shows the fork server's command line for a rank, and
``/proc/<pid>/environ`` holds the server's environment (the rank's own, with ``RANK``, is its ``os.environ``);
torchrun's agent stops a forked rank by signalling its pid, not its process group (the rank's watcher,
``grpo_mega.run.reaper``, ends the group's helpers once the rank is gone). CUDA builds of torch keep torchrun's
processes (see ``grpo_mega.run.launcher._start_method``), and ``GRPO_MEGA_FORK_RANKS=0`` keeps them here too.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import sys
import threading
from pathlib import Path

from grpo_mega.run.lifeline import LAUNCHER_ENV, tie_to_launcher
from grpo_mega.run.module_main import end_by_sigint, flush_standard_streams, run_module_as_main
from grpo_mega.run.procfs import alive

FORK_RANKS_ENV = "GRPO_MEGA_FORK_RANKS"
"""Set to ``0`` to have torchrun start every rank as a new interpreter even on a CPU build of torch."""


def forks_ranks(command: list[str], module: str) -> bool:
    """Whether the ranks of torchrun's ``command`` (its ``python -u -m <module> ...`` for each rank) can be forked:
    a CPU build of torch with a fork server, a plain ``-m`` command (no ``--local-rank`` argument added), not
    switched off by :data:`FORK_RANKS_ENV`."""
    return (forking_allowed() and command[:3] == ["-u", "-m", module]
            and not any(arg.startswith("--local-rank") for arg in command))


def forking_allowed() -> bool:
    """Whether this machine and its user let ranks be forked at all: not switched off by :data:`FORK_RANKS_ENV`, a
    fork server, and a CPU build of torch (a CUDA or ROCm one keeps torchrun's interpreters)."""
    import multiprocessing

    return (os.environ.get(FORK_RANKS_ENV, "1") != "0" and "forkserver" in multiprocessing.get_all_start_methods()
            and _torch_built_for_cpu_only())


PR_SET_NAME = 15
"""prctl(2) option: this thread's name (the process's, for its main thread)."""


def rank_process_name(rank: str) -> str:
    """The name (``/proc/<pid>/comm``, what ``ps -o comm``, ``top`` and ``pgrep`` show) of a forked rank."""
    return f"grpo-rank-{rank}"[:15]


def _name(rank: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(rank_process_name(rank).encode()), 0, 0, 0)


def _unbuffered_streams() -> None:
    """``python -u``: stdout and stderr write through to their file descriptors."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        encoding = getattr(stream, "encoding", None) or "utf-8"
        errors = getattr(stream, "errors", None) or "strict"
        stream.flush()
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors,
                                            write_through=True))


def _torch_built_for_cpu_only() -> bool:
    """What ``torch.version`` says of the installed torch (no CUDA, no ROCm), read without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    namespace: dict = {}
    try:
        exec(compile(path.read_text(), str(path), "exec"), namespace)  # torch's own file: plain assignments
    except (OSError, SyntaxError):
        return False
    return namespace.get("cuda") is None and namespace.get("hip") is None


def start_the_server_early(launcher_arguments: list[str]) -> None:
    """Start the fork server now, for a launcher of a ``-m`` command whose ranks will be forked, so that it imports
    torch, megatron-core and transformers on a second core while the launcher imports torch and meets the other
    nodes (it would otherwise start only when the ranks do, after both). Nothing where the ranks will not be forked,
    nor where a shared server is offered (``grpo_mega.run.shared_fork_server``): the ranks are forked from that one."""
    from grpo_mega.run.launcher import fork_from_a_preloaded_server

    if {"-m", "--module"} & set(launcher_arguments) and forking_allowed():
        fork_from_a_preloaded_server()


LAUNCHER_POLL_S = 0.5
"""How often a rank checks that its launcher is still there (where the kernel cannot tell it: a shared server)."""


def _end_once_the_launcher_is_gone(launcher: int, finished: threading.Event) -> None:
    """Once the process ``launcher`` is gone (killed with its node, a SIGKILL to the command): SIGKILL this rank if
    its module still runs (its helpers go with it: ``grpo_mega.run.reaper``); exit with status 0 if it has
    ``finished``, as torchrun's wrapper would otherwise wait forever for the gone agent to read its return value.
    A rank forked from its launcher's own server is killed by the kernel first (``grpo_mega.run.lifeline``)."""
    import time

    def watch() -> None:
        while alive(launcher):
            time.sleep(LAUNCHER_POLL_S)
        if not finished.is_set():
            os.kill(os.getpid(), signal.SIGKILL)
        flush_standard_streams()
        os._exit(0)

    threading.Thread(target=watch, name="grpo-launcher-watch", daemon=True).start()


def run_rank(launcher: int, module: str, *arguments: str) -> None:
    """One rank: ``python -u -m module *arguments`` in this forked process (see the module's docstring), started by
    the process ``launcher`` (torchrun's agent, whose environment and streams the rank took on arrival: a
    ``grpo_mega.run.shared_fork_server.LauncherSide`` in its arguments, unpickled as the agent's pid)."""
    os.setsid()
    os.environ.pop(LAUNCHER_ENV, None)  # its parent is a fork server, not the agent: not for the CLI's check
    # torch's wrapper has set SIGINT on the fork server's death (a Ctrl-C, to the CLI): ours, SIGKILL, again
    if not tie_to_launcher(launcher):
        os._exit(0)
    finished = threading.Event()
    _end_once_the_launcher_is_gone(launcher, finished)
    _name(os.environ.get("RANK", "?"))
    _unbuffered_streams()
    code, interrupted = run_module_as_main(module, arguments)
    if interrupted:
        end_by_sigint()
    if code is None or code == 0:
        finished.set()
        return  # torchrun's agent waits for every rank's return value: a SystemExit(0) would not give one
    if not isinstance(code, int):
        print(code, file=sys.stderr, flush=True)
        code = 1
    raise SystemExit(code)
