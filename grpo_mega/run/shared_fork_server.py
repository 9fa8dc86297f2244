"""One preloaded fork server for many commands: the ranks of every command a process starts forked from it, so torch,
megatron-core and transformers are imported once in all, not once per command (CPU builds of torch).

Each command that forks its ranks (``grpo_mega.run.forked_ranks``, ``grpo_mega.run.launcher.spawn_local_ranks``)
starts a fork server of its own, which imports :data:`grpo_mega.run.launcher.PRELOADED` first: 6-7 s of CPU on a
2-core machine, most of a tiny command's time. A pipeline of commands (the test suite, ``grpo-mega quickstart``)
pays it per command. Here the pipeline starts one server (:class:`SharedForkServer`, the standard library's
``multiprocessing.forkserver`` server, preloaded once) and offers it to its commands in :data:`SHARED_FORK_SERVER_ENV`;
a command that finds the offer (:func:`use_if_offered`) sends its fork requests there instead of starting a server.

A rank forked from a server that is not its launcher's own still runs as one forked by its launcher would
(:class:`LauncherSide`, unpickled in the rank before anything of it runs): the launcher's environment of the moment
it starts the rank, its standard output and error (the server's would be the pipeline's), and the launcher's pid
for the rank's check that its launcher is still there. Its working directory and ``sys.path`` are the launcher's as
before (multiprocessing's preparation data). What differs: the rank's parent is the shared server, not a server
the launcher started, so it is not among the launcher's descendants (``ps --forest``, ``psutil.children``); tools
that find a command's ranks through its process tree need a command without the offer.

The offer is not taken under SLURM (a job step's ranks belong to its node and its cgroup, and must not be forked
by a server outside it) nor where ranks are not forked at all (CUDA builds of torch, ``GRPO_MEGA_FORK_RANKS=0``).
The server ends with the process that started it (it reads end-of-file on a pipe only that process holds).
"""

from __future__ import annotations

import os
import stat

from grpo_mega.run.procfs import alive

SHARED_FORK_SERVER_ENV = "GRPO_MEGA_FORK_SERVER"
"""``<server pid>:<authentication key, hex, empty where Python has none>:<unix socket path>`` of a running shared
fork server, set by the process that started it for the commands it starts."""


class SharedForkServer:
    """A fork server preloaded with ``preload``, started now and kept until :meth:`stop` (or this process's end)."""

    def __init__(self, preload: list[str]):
        from multiprocessing.forkserver import ForkServer

        self._server = ForkServer()
        self._server.set_forkserver_preload(preload)
        self._server.ensure_running()

    @property
    def pid(self) -> int:
        return self._server._forkserver_pid

    @property
    def offer(self) -> str:
        """The value of :data:`SHARED_FORK_SERVER_ENV` for the commands that should use this server."""
        key = getattr(self._server, "_forkserver_authkey", b"") or b""  # Python >= 3.14 authenticates its clients
        return f"{self.pid}:{key.hex()}:{self._server._forkserver_address}"

    def stop(self) -> None:
        """End the server now: asked to stop, it would first finish its preload (up to a minute of CPU, measured:
        75 s of a 3-test session's teardown on a loaded machine, 2026-12-07). Processes it forked live on."""
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._server._stop()


def _offered_server(environ) -> tuple[int, str, bytes] | None:
    """(pid, socket path, key) of the server offered in ``environ``, if it runs and may serve this process."""
    offer = environ.get(SHARED_FORK_SERVER_ENV, "")
    pid, _, rest = offer.partition(":")
    key, _, address = rest.partition(":")
    if not (pid.isdigit() and address) or "SLURM_JOB_ID" in environ:
        return None
    try:
        if not (alive(pid) and stat.S_ISSOCK(os.stat(address).st_mode)):
            return None
        return int(pid), address, bytes.fromhex(key)
    except (OSError, ValueError):
        return None


def is_offered(environ=os.environ) -> bool:
    """Whether ``environ`` offers a running server this process may use (see :func:`use_if_offered`)."""
    return _offered_server(environ) is not None


def offered_server_pid(environ=os.environ) -> int | None:
    """The pid of the server offered in ``environ`` where this process may use it (:func:`is_offered`), else None:
    the parent of the ranks forked for a command that took the offer (``bench/faults.py``'s ``rank_pid``)."""
    offered = _offered_server(environ)
    return None if offered is None else offered[0]


def use_if_offered(environ=os.environ) -> bool:
    """Send this process's ``forkserver`` requests to the server offered in ``environ``; False (nothing changed)
    where none is offered, it is gone, or this process runs under SLURM."""
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker

    offered = _offered_server(environ)
    if offered is None:
        return False
    _, address, key = offered
    server = multiprocessing.forkserver._forkserver
    with server._lock:
        # A process forked from the server (a command's work, grpo_mega.run.forked_command) finds the server's own
        # address there already (the server sets it in itself), without the rest: the patch below tells them apart.
        adopted = vars(server).get("ensure_running") is resource_tracker.ensure_running
        if server._forkserver_address != address or not adopted:
            server._forkserver_address = address
            # Sent to each rank as the "alive" end of its own server's pipe, which the rank never reads: any open fd.
            server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
            if hasattr(server, "_forkserver_authkey"):
                server._forkserver_authkey = key
            # The shared server is not this process's child: ensure_running's waitpid check does not apply to it.
            server.ensure_running = resource_tracker.ensure_running
    return True


class LauncherSide:
    """Put in a forked rank's arguments: pickled when the launcher starts the rank, it carries the launcher's pid,
    environment and standard output / error (and input, with ``standard_input``) into the rank, where its unpickling
    adopts them and leaves the launcher's pid in the argument's place, before the rank's own code runs (torchrun's
    wrapper then adds the rank's variables to that environment)."""

    def __init__(self, standard_input: bool = False):
        self.descriptors = (0, 1, 2) if standard_input else (1, 2)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        streams = {fd: DupFd(fd) for fd in self.descriptors if is_open_fd(fd)}
        return _adopt_launcher_side, (os.getpid(), dict(os.environ), streams)


def is_open_fd(fd: int) -> bool:
    """Whether this process has file descriptor ``fd`` open."""
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _adopt_launcher_side(launcher: int, environ: dict[str, str], streams: dict) -> int:
    """The first code of ours a forked process runs (it unpickles its arguments; the rest of them, torch's queues
    among them, come after): end with the launcher (``grpo_mega.run.lifeline.tie_to_launcher``), quietly at once if
    it has gone already (it has said what ended it: nothing here would be of use), then take on its side."""
    import signal

    from grpo_mega.run.interrupts import pause_point
    from grpo_mega.run.lifeline import tie_to_launcher

    # A Ctrl-C before the process's own handler (the CLI's first call) ends it without a word: its launcher says
    # what happened. A launcher's own server ignores SIGINT and blocks it, and SIGTERM (lifeline.arm_fork_server), and
    # its processes would keep doing so.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if not tie_to_launcher(launcher):
        os._exit(0)
    os.environ.clear()
    os.environ.update(environ)
    for fd, inherited in streams.items():
        source = inherited.detach()
        if source != fd:
            os.dup2(source, fd)
            os.close(source)
    pause_point("fork.arrive")  # tests: a Ctrl-C or SIGKILL to the launcher while its ranks are being forked
    return launcher


def without_offer(environ=None) -> dict[str, str]:
    """``environ`` (default: this process's) without a shared server's offer: a command started with it forks its
    ranks from a server of its own, its child, so they are among the command's descendants."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k != SHARED_FORK_SERVER_ENV}
