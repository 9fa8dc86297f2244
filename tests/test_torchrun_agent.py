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

