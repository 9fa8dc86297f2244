"""grpo_mega.run.torchrun's changes to torchrun's agent that only make it cheaper: the same results, less CPU."""

from __future__ import annotations

import inspect

import pytest


def test_rendezvous_events_get_their_caller_s_name_without_a_walk_of_the_stack(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from grpo_mega.run.torchrun import _name_rendezvous_events_cheaply

    original = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)  # put back after the test
    _name_rendezvous_events_cheaply()
    cheap = dynamic_rendezvous.get_method_name
    assert cheap is not original

    def _record(name_of):  # as the rendezvous's _record calls it: depth 2 is the method that records
        return name_of()

    def join_rendezvous():
        return _record(original), _record(cheap)

    assert join_rendezvous() == ("join_rendezvous", "join_rendezvous")
    for depth in (0, 1, 3, 100_000):  # 100,000 frames up: none there
        assert cheap(depth) == original(depth)
    assert cheap(100_000) == "no_method_name"

    def no_stack_walk(*args, **kwargs):
        raise AssertionError("inspect.stack() called")

    def close():
        return _record(cheap)

    monkeypatch.setattr(inspect, "stack", no_stack_walk)
    assert close() == "close"
    with pytest.raises(AssertionError, match="inspect.stack"):
        original()


def test_an_exit_without_teardown_still_joins_threads_runs_exit_functions_and_flushes():
    """grpo_mega.run.torchrun's end (``module_main.exit_without_teardown``): what the interpreter's own exit does that
    anyone can see is done, in its order; only the freeing of the modules is left out."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)  # this checkout's grpo_mega, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    script = ("import atexit, sys, threading, time\n"
              "from grpo_mega.run.module_main import exit_without_teardown\n"
              "atexit.register(lambda: print('exit function', flush=False))\n"
              "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=False))).start()\n"
              "sys.stdout.write('unflushed ')\n"
              "sys.stderr.write('err unflushed')\n"
              "exit_without_teardown(3)\n"
              "print('not reached')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env=env)
    assert result.returncode == 3
    assert result.stdout == "unflushed thread done\nexit function\n"
    assert result.stderr == "err unflushed"


def test_a_module_run_in_a_forked_process_runs_its_own_finalizers_not_the_server_s(tmp_path):
    """``module_main.run_module_as_main`` in a process forked from a server: the folder a finalizer of the server's
    would delete (as wandb's temporary folders, made at its import) stays; the module's own finalizer runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "probe_module.py").write_text(
        "import weakref\nclass Thing: pass\nthing = Thing()\n"
        "weakref.finalize(thing, print, \"the module's finalizer\", flush=True)\n")
    script = ("import multiprocessing, os, sys, tempfile\n"
              "from grpo_mega.run.module_main import run_module_as_main\n"
              "server_folder = tempfile.TemporaryDirectory(prefix='server-')\n"
              "def forked():\n"
              "    sys.exit(run_module_as_main('probe_module', [])[0])\n"
              "process = multiprocessing.get_context('fork').Process(target=forked)\n"
              "process.start(); process.join()\n"
              "print(os.path.isdir(server_folder.name), process.exitcode, flush=True)\n")
    repo = str(Path(__file__).resolve().parent.parent)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}  # no torch import
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "the module's finalizer\nTrue 0\n"
