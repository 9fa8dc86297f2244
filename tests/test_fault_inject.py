"""bench/fault_inject.py's ``GRPO_FAULT_AFTER``: a due fault of any kind waits for that path before it fires (the
async chaos tests order a fault after another rank's publish with it)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import fault_inject  # noqa: E402  (bench/fault_inject.py)
from grpo_mega.run import failure  # noqa: E402
from grpo_mega.stages.update import UpdateRunner  # noqa: E402


def test_a_due_exception_fault_waits_for_the_after_path_then_fires_once(tmp_path, monkeypatch):
    after, mark = tmp_path / "latest", tmp_path / "fired"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GRPO_FAULT_AFTER", str(after))
    monkeypatch.setenv("GRPO_FAULT_MARK", str(mark))
    monkeypatch.setattr(UpdateRunner, "run", lambda self, *args, **kwargs: "updated")  # undone after the test
    monkeypatch.setitem(failure.POSITION, "step", 2)
    fault_inject.plant("exception", 0, 3)

    assert UpdateRunner.run(None) == "updated"  # step 2: not due, no wait
    assert not mark.exists()
    failure.POSITION["step"] = 3
    delay = 0.5
    threading.Timer(delay, after.touch).start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="fault injected by bench/faults.py: update, rank 0, step 3"):
        UpdateRunner.run(None)
    assert time.monotonic() - started >= delay * 0.9 and mark.exists()  # fired only once the path existed
    assert UpdateRunner.run(None) == "updated"  # fired once


def test_a_fault_planted_for_another_rank_never_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("GRPO_FAULT_AFTER", str(tmp_path / "never"))
    monkeypatch.setattr(UpdateRunner, "run", lambda self, *args, **kwargs: "updated")
    monkeypatch.setitem(failure.POSITION, "step", 3)
    fault_inject.plant("exception", 0, 3)
    started = time.monotonic()
    assert UpdateRunner.run(None) == "updated"
    assert time.monotonic() - started < 5
