"""grpo_mega.run.procfs: what the launcher's rank watcher and the fault tests read of a process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from grpo_mega.run.procfs import alive, command_line, parent_of, stat_fields


def test_a_running_process_its_parent_and_command_line():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-argument"])
    try:
        assert alive(child.pid)
        assert parent_of(child.pid) == os.getpid()
        # Popen returns once the child's exec has closed its close-on-exec pipe, which the kernel does before it lays
        # out the new program's arguments: until then the command line reads empty (the fresh-clone run of
        # 2026-12-03, under load). What the process runs is read once the exec is through.
        deadline = time.monotonic() + 30
        while command_line(child.pid) == b"" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert command_line(child.pid).split(b"\0")[-2] == b"marker-argument"
        assert stat_fields(child.pid)[0] in {"R", "S", "D"}
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_not_alive_and_a_reaped_process_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while stat_fields(child.pid)[:1] != ["Z"] and time.monotonic() < deadline:  # exited, not yet waited for
        time.sleep(0.05)
    assert stat_fields(child.pid)[:1] == ["Z"]
    assert not alive(child.pid)
    assert parent_of(child.pid) == os.getpid()
    child.wait()
    assert stat_fields(child.pid) == [] and not alive(child.pid)
    assert parent_of(child.pid) is None and command_line(child.pid) == b""


def test_a_command_name_with_brackets_and_spaces_is_cut_at_its_last_bracket():
    # the name field of /proc/<pid>/stat is "(name)"; a name may itself hold ") S 1 (" and would shift the fields
    rename = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) Z 1 (y', 0, 0, 0); time.sleep(30)"  # PR_SET_NAME
    child = subprocess.Popen([sys.executable, "-c", rename])
    try:
        deadline = time.monotonic() + 30
        while b"x) Z" not in open(f"/proc/{child.pid}/stat", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child.pid) and parent_of(child.pid) == os.getpid()
    finally:
        child.kill()
        child.wait()
