"""Issue 79 item 4: a Ctrl-C during a save reached megatron-core's forked checkpoint writers (one process per write
bucket, in the command's process group), and each printed a KeyboardInterrupt traceback beside the command's one
line. The writers ignore SIGINT; the saving process, which takes it, is untouched."""

from __future__ import annotations

import os
import signal

from grpo_mega.checkpoint.write_results import _ignoring_ctrl_c, keep_write_results_in_process


def test_the_writer_entry_point_ignores_ctrl_c_in_its_own_process_only():
    before = signal.getsignal(signal.SIGINT)
    writer = _ignoring_ctrl_c(lambda bucket: (bucket, signal.getsignal(signal.SIGINT)))
    pid = os.fork()
    if pid == 0:  # as megatron-core runs it: in a forked process
        bucket, handler = writer("bucket-0")
        os._exit(0 if (bucket, handler) == ("bucket-0", signal.SIG_IGN) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert signal.getsignal(signal.SIGINT) is before  # this process still takes Ctrl-C


def test_megatron_cores_writer_is_wrapped_once():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    keep_write_results_in_process()
    wrapped = FileSystemWriterAsync.write_preloaded_data
    keep_write_results_in_process()
    assert wrapped._ignores_ctrl_c and FileSystemWriterAsync.write_preloaded_data is wrapped
    assert "write_bucket" in __import__("inspect").signature(wrapped).parameters  # megatron-core reads its signature
