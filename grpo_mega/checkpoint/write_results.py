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
"""

from __future__ import annotations

import queue


def keep_write_results_in_process() -> None:
    """Give megatron-core's writer an in-process results queue unless it has one. Only for synchronous saves (see
    the module docstring)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()
