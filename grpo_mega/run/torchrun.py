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
  status 128 + the signal.

The agent's own log lines (``Sending process ... closing signal``, ``failed (exitcode: 1)``) are left out unless
``LOGLEVEL`` is set (torch's variable for them: ``LOGLEVEL=INFO`` shows the rendezvous too).
"""

from __future__ import annotations

import os
import signal
import socket
import sys

LAUNCHER = "grpo-mega launcher (torchrun)"


def _quiet_agent_logs() -> None:
    """Import torchrun with its agent's loggers at CRITICAL, unless the user set LOGLEVEL: those made by torch's
    ``get_logger`` set their level from LOGLEVEL when their module is imported (the ranks inherit the environment as
    it was), the others inherit the ``torch.distributed.elastic`` logger's."""
    import logging

    quiet = "LOGLEVEL" not in os.environ
    if quiet:
        os.environ["LOGLEVEL"] = "CRITICAL"
    try:
        import torch.distributed.run  # noqa: F401
    finally:
        if quiet:
            del os.environ["LOGLEVEL"]
    if quiet:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


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
    _quiet_agent_logs()
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
    sys.exit(main())
