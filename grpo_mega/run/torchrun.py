"""torchrun, with a failure said in one line: ``python -m grpo_mega.run.torchrun`` takes torchrun's options
(``torch.distributed.run``) and starts the ranks the same way; what differs is how a failed job ends.

torchrun ends a job whose rank failed with its agent's log lines, a traceback of its own and a ``ChildFailedError``
banner (about 40 lines under the rank's own line, and exit status 1 whatever the rank's was). Our ranks name their
failure themselves (``grpo_mega.run.failure``: one line, the traceback in the run folder), so here:

- a rank that exited with a status: the job exits with the status of the first rank that failed (3 for a run that
  stopped early with a checkpoint, 130 for an interrupt, 2 for a config error), nothing printed;
- a rank killed by a signal before it could say why (the kernel's OOM killer, a kill from outside): one line naming
  the rank, the host and the signal, exit status 128 + the signal;
- the agent itself failing (its rendezvous or store lost with the node that hosted it, a rendezvous that timed out):
  one line in the ranks' form, ``<launcher> on HOST failed (cause=peer_lost) ...``, which the SLURM scripts read as
  a transient fault (``launch/slurm/common.sh``), exit status 1;
- a stop signal to the agent (a scheduler's SIGTERM, Ctrl-C): the ranks got it too and said what they did; exit
  status 128 + the signal; a Ctrl-C before the ranks started (the agent importing torch, its rendezvous): one line,
  exit status 130.

A command started with ``--nproc N`` becomes this launcher (:func:`relaunch_with_torchrun`: by exec, or in the
process its work was forked into, ``grpo_mega.run.forked_command``).

The agent's own log lines (``Sending process ... closing signal``, ``failed (exitcode: 1)``) are left out unless
``LOGLEVEL`` is set (torch's variable for them: ``LOGLEVEL=INFO`` shows the rendezvous too).

And no process of the job outlives this launcher, however it ends (a SIGKILL too; torchrun leaves its ranks running
then): its fork server and the ranks, forked or started as interpreters, die with it (``grpo_mega.run.lifeline``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from grpo_mega.perf.startup import COMMAND_START_ENV, process_start_time
from grpo_mega.run.interrupts import (EXIT_INTERRUPTED, REPEAT_WINDOW_S, catch_ctrl_c, end_interrupted,
                                       exec_holding_ctrl_c, import_torch_holding_ctrl_c,
                                       is_a_programs_own_process, pause_point)
from grpo_mega.run.lifeline import LAUNCHER_ENV

LAUNCHER = "grpo-mega launcher (torchrun)"


AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
"""The loggers of torchrun's agent: torch's ``get_logger`` gives each its own level, from LOGLEVEL, at its import."""


def _quiet_agent_logs() -> None:
    """Import torchrun with its agent's loggers at CRITICAL, unless the user set LOGLEVEL: those made by torch's
    ``get_logger`` set their level from LOGLEVEL when their module is imported (the ranks inherit the environment as
    it was), the others inherit the ``torch.distributed.elastic`` logger's. Those imported before (by the server a
    command's work was forked from) get the level this import would have given them."""
    import logging

    quiet = "LOGLEVEL" not in os.environ
    # torch's C++ warnings too, in this process only (read when torch is imported; the ranks get the environment as
    # it was): a store lost with the node that hosted it prints a 30-frame TCPStore trace where _agent_failed says
    # it in one line
    quiet_cpp = quiet and "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["LOGLEVEL"] = "CRITICAL"
    if quiet_cpp:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch.distributed.run  # noqa: F401

        level = os.environ["LOGLEVEL"]
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if (name.startswith(AGENT_LOGGERS) and isinstance(logger, logging.Logger)
                    and logger.level != logging.NOTSET):  # one of get_logger's (the others inherit a level)
                logger.setLevel(level)
    finally:
        if quiet:
            del os.environ["LOGLEVEL"]
        if quiet_cpp:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    if quiet:
        # torch.multiprocessing's: the ranks' process context when they are forked (grpo_mega.run.forked_ranks)
        for name in ("torch.distributed.elastic", "torch.multiprocessing"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child_failed(error) -> int:
    """The exit status for torchrun's ChildFailedError (the line for a rank killed without a word)."""
    rank, failure = error.get_first_failure()
    if failure.exitcode > 0:
        return failure.exitcode
    number = -failure.exitcode
    print(f"{LAUNCHER}: rank {rank} on {socket.gethostname()} (pid {failure.pid}) was killed by "
          f"{_signal_name(number)} before it named a cause (out of memory? see `dmesg`; or killed from outside)",
          file=sys.stderr, flush=True)
    return 128 + number


def _agent_failed(error: BaseException) -> int:
    """One line for the agent's own failure, classified as a rank's would be (a lost rendezvous is peer_lost)."""
    from grpo_mega.run.failure import classify

    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(f"{LAUNCHER} on {socket.gethostname()} failed (cause={classify(error)}) in the rendezvous or store: "
          f"{type(error).__name__}: {first}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    try:
        # also when started with SIGINT ignored, or blocked (a Ctrl-C in the command's exec to this launcher is
        # raised here); exec gives the ranks SIGINT at its default again
        catch_ctrl_c()
        pause_point("launcher")  # tests: a Ctrl-C while the launcher imports torch
        return _launch(argv)
    except KeyboardInterrupt:  # before the agent's own handler (then: SignalException) took over
        print(f"{LAUNCHER}: interrupted before the ranks started; run the same command again", file=sys.stderr,
              flush=True)
        if argv is None and is_a_programs_own_process():
            end_interrupted()  # exit 130, whatever an interrupted import left to the interpreter's finalization
        return EXIT_INTERRUPTED


def _run_in_this_process(arguments: list[str]) -> int:
    """``python -m grpo_mega.run.torchrun ARGUMENTS``'s work in this process, a command's work forked from a
    preloaded server (``grpo_mega.run.forked_command``) that has torch imported: set up as that new interpreter
    would be (the root logger without the command's handler and level; the agent's loggers as :func:`_launch` sets
    them), its exit status returned."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    return main(arguments)


def relaunch_with_torchrun(nproc: int, module_args: list[str], threads_per_process: int | None = None) -> int:
    """Become ``python -m grpo_mega.run.torchrun --standalone --nproc-per-node nproc -m <module_args>``: torchrun,
    with a failure said in one line (exec: this process is replaced, so signals sent to it, e.g. a scheduler's
    SIGTERM, reach torchrun and through it the ranks). Does not return, except in a command's work forked from a
    preloaded server (``grpo_mega.run.forked_command``): there torchrun runs in this process, which has torch
    imported already, and its exit status is returned (the command's process passes the signals on to it).

    Each process gets ``threads_per_process`` intra-op threads (default: cores / nproc), so ranks sharing a
    machine do not oversubscribe its cores.
    """
    from grpo_mega.run.forked_command import in_forked_command
    from grpo_mega.run.launcher import threads_per_rank

    threads = threads_per_process or threads_per_rank(nproc)
    # "--" ends torchrun's own options: its parser would otherwise reject, as ambiguous abbreviations of its flags,
    # our flags such as --n or --nproc anywhere in the command line.
    arguments = ["--standalone", f"--nproc-per-node={nproc}", "-m", "--", *module_args]
    # the ranks count what passes before their start as "launch", from the start of the command's process: this one
    # (exec keeps it), or the one that forked this work (which set the variable)
    started = repr(process_start_time())
    if in_forked_command():
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ.setdefault(COMMAND_START_ENV, started)
        return _run_in_this_process(arguments)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **{COMMAND_START_ENV: started})
    sys.stdout.flush()
    sys.stderr.flush()
    exec_holding_ctrl_c(sys.executable, [sys.executable, "-m", "grpo_mega.run.torchrun", *arguments], env)


def _stop_signals_once() -> None:
    """Make torchrun's agent take a repeat of the same stop signal within ``REPEAT_WINDOW_S`` as the same stop:
    one Ctrl-C reaches it twice when a pipeline forwards it to its command, and the second SignalException would
    cut short the agent's shutdown of the ranks (they would be left to end on their own, after it exited)."""
    import time

    from torch.distributed.elastic.multiprocessing import api

    original, first = api._terminate_process_handler, {}

    def terminate_once(signum, frame):
        now = time.monotonic()
        if signum in first and now - first[signum] < REPEAT_WINDOW_S:
            return
        first[signum] = now
        original(signum, frame)

    api._terminate_process_handler = terminate_once  # looked up when the agent starts the ranks


def _name_rendezvous_events_cheaply() -> None:
    """Have torch's rendezvous name the events it records by their caller from the caller's frame, not from
    ``inspect.stack()``: it names each event (9 a job: join, keep-alive, completion, close) before it checks whether
    events are recorded at all (by default they are not), and ``inspect.stack()`` reads the source of every frame
    and finds each frame's module by a scan of ``sys.modules``. Where a command's work was forked from a preloaded
    server (``grpo_mega.run.forked_command``: 4,000 modules) that was 1.5-3 s of CPU a command, before the ranks
    started and after they ended (measured 2026-12-08). The name is the same: the function ``depth`` frames up."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # frame 0 is this function's, as inspect.stack()[0] is
        except ValueError:  # fewer frames than that
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name  # looked up by name at each call


def _fork_ranks_when_they_can() -> None:
    """Have torchrun fork the ranks of a ``-m`` command from a preloaded server where they can be
    (``grpo_mega.run.forked_ranks``): its ``config_from_args`` gives the agent :func:`forked_ranks.run_rank` as
    a function entrypoint and the ``forkserver`` start method instead of the ``python -u -m`` command line; the
    server is a shared one where it is offered (``grpo_mega.run.shared_fork_server``)."""
    import torch.distributed.run as torchrun

    from grpo_mega.run import forked_ranks
    from grpo_mega.run.launcher import fork_from_a_preloaded_server
    from grpo_mega.run.shared_fork_server import LauncherSide

    original = torchrun.config_from_args

    def config_from_args(args):
        config, command, command_args = original(args)
        if not (args.module and forked_ranks.forks_ranks(command_args, args.training_script)):
            return config, command, command_args
        config.start_method = "forkserver"
        fork_from_a_preloaded_server()
        return config, forked_ranks.run_rank, [LauncherSide(), *command_args[2:]]

    torchrun.config_from_args = config_from_args  # looked up by run() when it is called


def _launch(argv: list[str] | None) -> int:
    from grpo_mega.run.forked_ranks import start_the_server_early

    # the ranks this agent starts as interpreters die with it (the forked ones die with its fork server)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    start_the_server_early(sys.argv[1:] if argv is None else argv)
    import_torch_holding_ctrl_c()  # before the agent's loggers' import (torch's own swallowed a Ctrl-C)
    _quiet_agent_logs()
    _stop_signals_once()
    _name_rendezvous_events_cheaply()
    _fork_ranks_when_they_can()
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as error:
        return _child_failed(error)
    except SignalException as error:
        return 128 + int(error.sigval)
    except (RendezvousError, DistError) as error:
        return _agent_failed(error)
    return 0


if __name__ == "__main__":
    from grpo_mega.run.module_main import exit_without_teardown

    exit_without_teardown(main())  # the ranks have ended: nothing is left to free but torch's modules
