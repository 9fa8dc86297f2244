"""The start-up clock (grpo_mega.perf.startup): phases from the process start, the launcher's command start as
``launch``, logged once. A training run's first metrics row carries them: tests/test_trainer_hardening.py."""

import os
import subprocess
import sys
import time

import pytest

from grpo_mega.perf.startup import COMMAND_START_ENV, StartupClock, process_start_time


def test_process_start_time_is_when_the_process_started():
    before = time.time()
    child = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); from grpo_mega.perf.startup import "
                            "process_start_time as p; print(p(), time.time())"], capture_output=True, text=True,
                           check=True)
    started, now = map(float, child.stdout.split())
    assert before - 0.05 <= started <= before + 0.3 and now - started >= 0.5
    assert process_start_time() < before  # this process, long before


def test_phases_count_from_the_start_add_up_and_are_reported_once(monkeypatch):
    monkeypatch.delenv(COMMAND_START_ENV, raising=False)
    clock = StartupClock(start=time.time() - 2.0)
    clock.mark("imports")
    time.sleep(0.1)
    clock.mark("model_build")
    clock.mark("imports")  # a phase marked again adds up
    metrics = clock.finish()
    assert metrics["startup_s/imports"] == pytest.approx(2.0, abs=0.05)
    assert metrics["startup_s/model_build"] == pytest.approx(0.1, abs=0.05)
    assert set(metrics) == {"startup_s/imports", "startup_s/model_build", "startup_s/other", "startup_s/total"}
    parts = sum(v for k, v in metrics.items() if k != "startup_s/total")
    assert metrics["startup_s/total"] == pytest.approx(parts)
    assert clock.finish() == {}
    clock.mark("late")  # after the first step: ignored
    assert "late" not in clock.seconds


def test_the_launchers_command_start_is_the_launch_phase_and_is_not_passed_on(monkeypatch):
    start = time.time() - 1.0
    monkeypatch.setenv(COMMAND_START_ENV, repr(start - 3.0))
    clock = StartupClock(start=start)
    assert clock.seconds == {"launch": pytest.approx(3.0)}
    assert COMMAND_START_ENV not in os.environ  # a command this process starts counts its own
    monkeypatch.setenv(COMMAND_START_ENV, "not a time")
    assert StartupClock(start=start).seconds == {}
    monkeypatch.setenv(COMMAND_START_ENV, repr(start + 5.0))  # after this process started: not this command's
    assert StartupClock(start=start).seconds == {}
