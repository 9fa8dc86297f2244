"""Failures after launch in one line (issue 51): a rank names its cause once on stderr and keeps its traceback in
the run folder (failure.json, tracebacks/rank<R>.txt); the launcher (grpo_mega.run.torchrun) adds no banner, exits
with the failed rank's status, names a rank killed without a word, and classifies its own lost rendezvous or store
as transient (peer_lost), as a rank's lost store is.

Before: a bad data row under `grpo-mega train --nproc 2` printed 87 lines on stderr (the right first line, then each
rank's traceback, torchrun's agent log lines, its own traceback and its ChildFailedError banner), exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.run.failure import POSITION, TRACEBACK_ENV, classify, exit_status, report_failure
from grpo_mega.run.torchrun import _agent_failed
from tiny_task import build_tiny_task, tiny_run_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"


@pytest.fixture(autouse=True)
def no_signal_received(monkeypatch):
    monkeypatch.setitem(POSITION, "signal", None)
    monkeypatch.setattr("grpo_mega.run.failure.DEFER_S", 0.0)


def test_a_lost_store_or_rendezvous_is_peer_lost_wherever_it_is_seen():
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    # what a rank on the surviving node raised at its store, and torchrun's agent in its rendezvous (issue 51's log)
    store = DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server "
                             "shutdown or crash?")
    assert classify(store) == "peer_lost"
    try:
        try:
            raise store
        except DistNetworkError as cause:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from cause
    except RendezvousConnectionError as agent:
        assert classify(agent) == "peer_lost"
    assert classify(RendezvousTimeoutError("rendezvous timed out")) == "collective_timeout"
    assert classify(DistStoreError("wait timeout after 30000ms, keys: /rank1")) == "collective_timeout"
    assert classify(ValueError("failed to recv the answer")) == "error"  # not distributed: not a lost peer


def test_the_launcher_names_its_own_lost_rendezvous_in_the_line_the_slurm_scripts_read(capsys):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    assert _agent_failed(RendezvousConnectionError("The connection to the C10d store has failed.\nmore")) == 1
    line, = capsys.readouterr().err.splitlines()
    assert "failed (cause=peer_lost)" in line and "RendezvousConnectionError" in line


def test_a_failure_already_named_by_another_rank_is_not_printed_twice(tmp_path, monkeypatch, capsys):
    def fail(message):
        try:
            raise ValueError(message)
        except ValueError as error:
            return error

    monkeypatch.setenv("RANK", "0")
    record = report_failure("grpo-mega train", tmp_path, fail("row 6 is bad"))
    assert exit_status(record) == 1 and exit_status({**record, "cause": "data"}) == 2
    monkeypatch.setenv("RANK", "1")
    report_failure("grpo-mega train", tmp_path, fail("row 6 is bad"))  # the same failure on the other rank: silent
    report_failure("grpo-mega train", tmp_path, fail("something else"))  # another: its own line
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].endswith("failure.json") and "rank 0" in lines[0], lines
    assert "something else" in lines[1] and lines[1].endswith("rank1.txt"), lines
    written = json.loads((tmp_path / "failure.json").read_text())
    assert "ValueError: row 6 is bad" in written["traceback"] and "in fail" in written["traceback"]
    assert "Traceback" not in "\n".join(lines)
    ranks = {path.name: path.read_text() for path in (tmp_path / "tracebacks").iterdir()}
    assert sorted(ranks) == ["rank0.txt", "rank1.txt"]
    assert ranks["rank1.txt"].count("=== ") == 2 and "something else" in ranks["rank1.txt"]
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    report_failure("grpo-mega train", tmp_path, fail("shown"))
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_peer_lost_after_the_rank_that_named_the_cause_stopped_is_silent(tmp_path, monkeypatch, capsys):
    """Rank 0 honoured a Ctrl-C after its save and left; rank 1, waiting at the next collective, lost it: the
    CI failure of test_ctrl_c_windows (two lines where one names the stop). A peer lost with no failure.json
    yet (the root cause's rank died without a word) still has its line: the SLURM scripts requeue on it."""
    def lost():
        try:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer")
        except RuntimeError as error:
            return error

    monkeypatch.setenv("RANK", "1")
    assert report_failure("grpo-mega train", tmp_path, lost())["cause"] == "peer_lost"
    alone = capsys.readouterr().err.splitlines()
    assert len(alone) == 1 and "failed (cause=peer_lost)" in alone[0] and alone[0].endswith("failure.json"), alone
    (tmp_path / "failure.json").rename(tmp_path / "failure.earlier.json")
    monkeypatch.setenv("RANK", "0")
    report_failure("grpo-mega train", tmp_path, KeyboardInterrupt())
    monkeypatch.setenv("RANK", "1")
    report_failure("grpo-mega train", tmp_path, lost())
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "rank 0" in lines[0], lines
    assert "cause=interrupted" in lines[0]
    assert (tmp_path / "tracebacks" / "rank1.txt").read_text().count("cause=peer_lost") == 2  # kept, not printed


def _torchrun(script: Path, body: str, timeout: int = 120) -> subprocess.CompletedProcess:
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "grpo_mega.run.torchrun", "--standalone", "--nproc-per-node=2",
                           str(script)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_launcher_exits_with_the_failed_rank_s_status_and_no_banner(tmp_path):
    result = _torchrun(tmp_path / "stop.py", "import os, sys, time\n"
                       "if os.environ['RANK'] == '0':\n    print('rank 0: stopped', file=sys.stderr); sys.exit(3)\n"
                       "time.sleep(60)\n")
    assert result.returncode == 3, result.stderr[-3000:]
    assert result.stderr.splitlines() == ["rank 0: stopped"], result.stderr[-3000:]


def test_a_rank_killed_without_a_word_is_named_in_one_line(tmp_path):
    result = _torchrun(tmp_path / "killed.py", "import os, signal, time\n"
                       "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n")
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    line, = result.stderr.splitlines()
    assert "rank 1" in line and "SIGKILL" in line and "before it named a cause" in line


def test_a_bad_data_row_under_nproc_2_is_one_line_with_the_traceback_in_the_run_folder(tmp_path):
    model_dir, train_file = build_tiny_task(tmp_path / "task")
    rows = train_file.read_text().splitlines()
    # a prompt over data.prompt_length (64 tokens): a bad row only the ranks find (they tokenize; the CLI's check
    # before launch reads fields, and would stop a row without a text prompt itself: tests/test_data_formats_cli.py)
    rows.insert(5, json.dumps({"prompt": "Q: Start with 2." + " Add 3." * 40 + " A:", "answer": "122"}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "grpo_mega.cli", "train", "--nproc", "2", "--config", str(CONFIG),
         *tiny_run_overrides((model_dir, bad), run_dir, "data.on_bad_row=error")],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr[-3000:]  # the user's data: the status of an input error
    line, = result.stderr.splitlines()  # one line for the cause both ranks met, no traceback, no banner
    assert "failed (cause=data)" in line and f"{bad}:6" in line and line.endswith("failure.json"), line
    assert "BadRowError" in json.loads((run_dir / "failure.json").read_text())["traceback"]
    assert sorted(path.name for path in (run_dir / "tracebacks").iterdir()) == ["rank0.txt", "rank1.txt"]


def test_a_full_disk_every_rank_meets_is_named_once_by_rank_0(tmp_path, monkeypatch, capsys):
    """A checkpoint too large for the disk: every rank's save fails with ENOSPC, each measuring its own free space.
    Rank 1 found the disk still full (it could write no failure.json) and printed its line before rank 0, which
    wrote failure.json once the partial save was gone: two lines (measured on a 6 MiB tmpfs, 2026-12-07). Rank 1 now
    waits for rank 0 and stays silent once rank 0 named the full disk; an error of its own still has its line."""
    import errno
    import threading

    from grpo_mega.run.failure import failure_record, write_exclusive

    def full(free_mib):
        try:
            raise OSError(errno.ENOSPC, f"the checkpoint of step 1 was not saved ({free_mib} MiB free of 6.0 MiB)")
        except OSError as error:
            return error

    monkeypatch.setattr("grpo_mega.run.failure.DEFER_S", 2.0)
    monkeypatch.setenv("RANK", "0")
    named_by_rank_0 = failure_record(full(0.4))
    rank_0 = threading.Timer(0.5, write_exclusive, (tmp_path / "failure.json", named_by_rank_0))  # rank 0 is later
    monkeypatch.setenv("RANK", "1")
    rank_0.start()
    assert report_failure("grpo-mega train", tmp_path, full(0.0))["cause"] == "disk_full"
    rank_0.join()
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "failure.json").read_text())["rank"] == 0
    report_failure("grpo-mega train", tmp_path, ValueError("row 3 is bad"))  # not the disk: its own line
    assert "row 3 is bad" in capsys.readouterr().err
