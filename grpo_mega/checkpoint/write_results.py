"""Where megatron-core's checkpoint writer hands back its write results, for the synchronous saves we make.

megatron-core's ``torch_dist`` writer (``dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync``,
0.16) forks one process per write bucket, gathers their results in the saving process, then passes them on through
a queue it creates on a process's first save: a ``spawn``-context ``multiprocessing.Manager().Queue()``. That manager
is a fresh interpreter, and unpickling the results (``torch.distributed.checkpoint`` objects) makes it import torch:
the first save of every rank cost 1.3-1.4 s more than the next ones (0.12 s for the quickstart model; measured with
cProfile in ``put``), and left one more process per rank running to the end of the job.

The queue is only crossed between processes by an asynchronous save (megatron's async request runs the writer in
another process). ``CheckpointManager.save`` always saves synchronously (``dist_checkpointing.save`` without
``async_sharded_save``): the results are put and taken in the saving process, so a plain ``queue.Queue`` serves and
no manager starts. Set once, before the first save; a megatron-core that no longer has the module attribute (or has
made its queue already) is left as it is.

The forked writers are in the command's process group: a Ctrl-C during a save reached them too, and each printed a
``KeyboardInterrupt`` traceback beside the command's one line (issue 79). They ignore SIGINT now
(:func:`keep_write_results_in_process` wraps their entry point once): the saving process takes the interrupt and
ends the run as any Ctrl-C does; a writer ends when its bucket is written (its folder is a staging one).
"""

from __future__ import annotations

import functools
import queue
import signal


def keep_write_results_in_process() -> None:
    """Give megatron-core's writer an in-process results queue unless it has one. Only for synchronous saves (see
    the module docstring)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()
    writer = getattr(filesystem_async, "FileSystemWriterAsync", None)
    write = getattr(writer, "write_preloaded_data", None)
    if write is not None and not getattr(write, "_ignores_ctrl_c", False):
        writer.write_preloaded_data = staticmethod(_ignoring_ctrl_c(write))


def _ignoring_ctrl_c(write):
    """``write`` (a forked writer's entry point) with SIGINT ignored in the process it runs in: the saving process
    handles the interrupt, the writer finishes its bucket without a traceback."""

    @functools.wraps(write)
    def forked_writer(*args, **kwargs):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return write(*args, **kwargs)

    forked_writer._ignores_ctrl_c = True
    return forked_writer
