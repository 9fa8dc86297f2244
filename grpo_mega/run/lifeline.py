"""No process of a job outlives the launcher that started it, however the launcher ends (a SIGKILL included).

The kernel does it: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` has a process killed the moment its parent ends, with no
thread of its own to poll and nothing the parent must do. Three links use it:

- the fork server a launcher starts (multiprocessing's ``forkserver``, preloading torch, megatron-core and
  transformers for 5-50 s) dies with the launcher (:func:`start_fork_server` names the launcher in
  :data:`SERVER_PARENT_ENV`, :func:`arm_fork_server` runs first in the server). Without it, a server whose launcher
  left (a Ctrl-C, a failed check, even a success before the server was needed) went on preloading at full CPU and
  ~0.5 GB, reparented to init, and then forked the ranks the launcher had asked for before it left, each failing
  with a multiprocessing traceback (``SemLock._rebuild ... FileNotFoundError``: the launcher's semaphores unlinked);
- a rank forked from that server dies with the server, so with the launcher
  (``grpo_mega.run.shared_fork_server._adopt_launcher_side``, the first code of ours a forked rank runs);
- a command a pipeline runs (``grpo_mega.run.commands.run_command``: ``quickstart``'s, ``bench/pipeline_seeds.py``'s)
  dies with the pipeline (it names itself in :data:`COMMAND_PARENT_ENV`; :func:`end_with_the_launcher`), its
  fork server and ranks with it as above. Without it, a pipeline killed by SIGKILL left its running ``train``
  (``grpo_mega.run.torchrun`` and its fork servers) training on with parent 1;
- a rank torchrun starts as an interpreter (CUDA builds of torch, ``GRPO_MEGA_FORK_RANKS=0``) dies with
  torchrun's agent when the agent is ours (``grpo_mega.run.torchrun`` names itself in :data:`LAUNCHER_ENV`;
  :func:`end_with_the_launcher`, the first call of the CLI).

The parent-death signal fires for a parent that ends *after* it was set; one that ended before has already made
the process an orphan, so each link checks its parent after setting it (the race a plain prctl leaves open).

torchrun differs on purpose here: its agent starts each rank in a session of its own with no parent-death signal
(``subprocess.Popen(start_new_session=True)``; only function entrypoints get torch's ``SIGINT`` on the death of
their parent, which a rank may catch), so a SIGKILLed torchrun leaves its ranks running to the end of their job:
on a GPU node that is devices held by a job its scheduler counts as ended, and a rendezvous store gone with the
agent. Our ranks cannot do anything of use without the launcher that gathers their exit statuses, so they end.
A rank forked from a shared server (``grpo_mega.run.shared_fork_server``: the test suite's, which outlives each
launcher) cannot use the kernel's signal; it watches its launcher's pid instead
(``grpo_mega.run.forked_ranks``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import threading

from grpo_mega.run.procfs import alive, parent_of

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent (the thread that forked it) ends."""
SERVER_PARENT_ENV = "GRPO_MEGA_FORK_SERVER_PARENT"
"""Set, for the start of a fork server only, to the pid of the launcher the server must end with."""
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
"""The resource tracker's warning filter (``PYTHONWARNINGS``): its leaked-objects notice after a killed launcher."""
LAUNCHER_ENV = "GRPO_MEGA_LAUNCHER_PID"
"""The pid of ``grpo_mega.run.torchrun``'s agent, in its ranks' environment: a rank whose parent it is ends with it."""
COMMAND_PARENT_ENV = "GRPO_MEGA_COMMAND_PARENT_PID"
"""The pid of the pipeline that runs a command (``run_command``), in that command's environment: it ends with it."""


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends (0: no signal); False where prctl(2) is
    not available (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int) -> bool:
    """SIGKILL this process when ``parent`` ends; False (and nothing set) when ``parent`` is no longer this process's
    parent once the signal is set: it ended before, or never was."""
    if not set_parent_death_signal(signal.SIGKILL):
        return True  # no prctl: nothing to rely on, nothing to refuse
    if os.getppid() != parent:
        set_parent_death_signal(0)
        return False
    return True


def start_fork_server(preload: list[str]) -> None:
    """Start this process's multiprocessing fork server now, preloading ``preload``, so that it ends with this
    process (from the main thread only: the kernel ties the parent-death signal to the thread that forked) and a
    Ctrl-C to the terminal's process group, which the server is in, does not interrupt its preload with a
    ``KeyboardInterrupt`` traceback: the server starts with SIGINT blocked (a mask survives fork and exec) and keeps
    it blocked (it ignores SIGINT itself once its preload is done), its processes unblock it
    (``shared_fork_server._adopt_launcher_side``). Blocked here for the spawn only, a Ctrl-C to this process is
    delivered once the server is started, not lost (ignoring it for the spawn could lose it)."""
    import multiprocessing
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker

    multiprocessing.set_forkserver_preload(preload)
    # started first: its own start blocks and then unblocks SIGINT, which would unblock it for the server's. Without
    # its warning on a SIGKILLed launcher ("There appear to be 9 leaked semaphore objects"): it unlinks them anyway.
    warnings = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [warnings, QUIET_TRACKER]))
    try:
        resource_tracker.ensure_running()
    finally:
        if warnings is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = warnings
    main_thread = threading.current_thread() is threading.main_thread()
    global _server_ends_first
    if not _server_ends_first:  # before the start: a Ctrl-C raised when the mask is restored must not skip it
        _server_ends_first = True
        atexit.register(_end_the_fork_server)  # runs before multiprocessing's own exit function (registered earlier)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:  # the block inside: pthread_sigmask raises the KeyboardInterrupt of a Ctrl-C taken before it, once set
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if main_thread:
            os.environ[SERVER_PARENT_ENV] = str(os.getpid())
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(SERVER_PARENT_ENV, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


_server_ends_first = False
"""Whether :func:`_end_the_fork_server` is registered to run at this process's exit."""


def _end_the_fork_server() -> None:
    """At the launcher's exit, before multiprocessing's finalizers unlink its semaphores: kill the fork server and
    wait until it is gone, so that every process it forked for this launcher that has not yet read its arguments
    (whose queues hold those semaphores) is killed with it (:func:`tie_to_launcher`) instead of failing on them
    with a traceback (``SemLock._rebuild ... FileNotFoundError``)."""
    import multiprocessing.forkserver

    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass


def arm_fork_server() -> None:
    """In a fork server started by :func:`start_fork_server`, before its preload: die with the launcher (and at
    once if it is already gone)."""
    parent = os.environ.pop(SERVER_PARENT_ENV, "")
    if parent.isdigit() and not die_with_parent(int(parent)):
        os._exit(0)  # the launcher left while this server started: nobody will ask it for a rank
    # A scheduler's stop signal reaches every process of the job step (slurmstepd's SIGTERM after a USR1): the ranks
    # save their step on it, and they die with this server; it goes with its launcher (above, and at the launcher's
    # exit), never on the stop signal itself. Its ranks take SIGTERM back (shared_fork_server._adopt_launcher_side).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def end_with_the_launcher(environ=os.environ) -> None:
    """In a rank torchrun started as an interpreter: die with ``grpo_mega.run.torchrun``'s agent when that is this
    process's parent (:data:`LAUNCHER_ENV`, consumed here so that processes this one starts do not read it as
    theirs); exit at once when the agent has already gone. In a command a pipeline started
    (:data:`COMMAND_PARENT_ENV`, consumed likewise): die with the pipeline, or exit at once when it has gone. The
    signal survives the command's exec of ``grpo_mega.run.torchrun``. Nothing anywhere else."""
    pipeline = environ.pop(COMMAND_PARENT_ENV, "")
    if pipeline.isdigit() and not die_with_parent(int(pipeline)):
        os._exit(1)  # the pipeline ended while this command started: nobody reads its result
    launcher = environ.pop(LAUNCHER_ENV, "")
    if not launcher.isdigit() or "TORCHELASTIC_RUN_ID" not in environ:
        return
    if not die_with_parent(int(launcher)) and not alive(launcher):
        os._exit(1)  # the agent was killed while this rank started: the job is over


def tie_to_launcher(launcher: int) -> bool:
    """In a process forked from a fork server for ``launcher``: die with the server where it is the launcher's own
    (it dies with the launcher, :func:`arm_fork_server`); no parent-death signal where it is a shared one, which
    outlives launchers. False when the launcher is already gone (or the server, which goes with it)."""
    server = os.getppid()
    if parent_of(server) == launcher:
        if not die_with_parent(server):
            return False
    else:
        set_parent_death_signal(0)
    return alive(launcher)
