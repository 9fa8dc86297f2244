"""Issue 79 item 4: a trainer.run_dir that is a file, lies under a file, is read-only or on a full disk is refused
in one line, exit status 2, before any rank starts (it failed 17-36 s after launch at the first save, with a bare
FileExistsError / PermissionError and a second line from the other rank)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.run import writable
from grpo_mega.run.shared_fork_server import SHARED_FORK_SERVER_ENV
from grpo_mega.run.writable import run_dir_problem

REPO = Path(__file__).resolve().parent.parent


def test_a_writable_folder_passes_and_the_probe_is_gone(tmp_path):
    assert run_dir_problem(tmp_path / "new" / "run") is None
    assert run_dir_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == [] and not (tmp_path / "new").exists()  # nothing made, nothing left


def test_a_file_and_a_folder_under_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    assert run_dir_problem(tmp_path / "notes.txt") == (
        f"trainer.run_dir={tmp_path / 'notes.txt'} is a file, not a folder: name a folder (it is created when missing)")
    assert run_dir_problem(tmp_path / "notes.txt" / "run") == (
        f"trainer.run_dir={tmp_path / 'notes.txt' / 'run'}: {tmp_path / 'notes.txt'} is a file, so no folder can be "
        "made under it: name another folder")


@pytest.mark.parametrize("code, why, fix", [
    (errno.ENOSPC, "the disk is full", "free space or name another folder"),
    (errno.EROFS, "the file system is read-only", "name a folder this user can write"),
    (errno.EACCES, "permission denied", "name a folder this user can write"),
])
def test_a_write_the_file_system_refuses(tmp_path, monkeypatch, code, why, fix):
    """The probe's write as a full, read-only or forbidden file system fails it (root passes mode bits, so the
    file system's answer is simulated here); the probe is removed either way."""
    def refuse(descriptor, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(writable.os, "write", refuse)
    assert run_dir_problem(tmp_path / "run") == (
        f"trainer.run_dir={tmp_path / 'run'}: cannot write in {tmp_path}, where it would be made ({why}): {fix}")
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_before_any_rank(tmp_path):
    """The command as a user types it, --nproc 2: one line, exit status 2, no rank started (a folder of /sys, which
    even root cannot write, stands for a read-only one)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 512}')
    (tmp_path / "train.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "afile").write_text("x")
    env = {key: value for key, value in os.environ.items() if key != SHARED_FORK_SERVER_ENV}
    env["PYTHONPATH"] = str(REPO)
    for run_dir, named in ((tmp_path / "afile", "is a file, not a folder"),
                           (Path("/sys/fs/grpo-mega-test/run"), "cannot write in /sys/fs")):
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(REPO / "configs" / "quickstart_grpo.yaml"),
             "--nproc", "2", f"model.hf_config={tmp_path / 'model'}", f"data.train_file={tmp_path / 'train.jsonl'}",
             f"trainer.run_dir={run_dir}"], capture_output=True, text=True, timeout=120, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and named in lines[0], result.stderr[-2000:]
        assert time.perf_counter() - start < 10
