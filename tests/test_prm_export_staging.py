"""prm/export.py's leftovers: a crashed export's staging folder is removed by the next export, another job's export
in progress is not."""

from __future__ import annotations

import os
import subprocess
import sys

from prm.export import STALE_STAGING_S, _STAGING_PREFIX, _host, remove_stale_staging


def _staging(folder, name):
    path = folder / f"{_STAGING_PREFIX}{name}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def test_a_dead_exporters_staging_goes_and_a_live_ones_stays_while_it_writes(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    working = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        crashed = _staging(tmp_path, f"{_host()}-{gone.pid}-0a1b2c3d")
        in_progress = _staging(tmp_path, f"{_host()}-{working.pid}-0a1b2c3d")
        export = tmp_path / "hf_export"
        export.mkdir()
        assert remove_stale_staging(tmp_path) == [crashed]
        assert not crashed.exists() and in_progress.exists() and export.exists()
        # a live pid whose folder saw no write for an hour: the pid was taken again by another program
        newest = (in_progress / "model.safetensors").stat().st_mtime
        assert remove_stale_staging(tmp_path, now=newest + STALE_STAGING_S + 1) == [in_progress]
        assert export.exists()
    finally:
        working.kill()
        working.wait()


def test_another_hosts_staging_goes_only_once_nothing_was_written_in_it_for_an_hour(tmp_path):
    other = _staging(tmp_path, f"node_elsewhere-{os.getpid()}-0a1b2c3d")
    unnamed = _staging(tmp_path, "0a1b2c3d")  # the name an export had before the host and pid were in it
    newest = (other / "model.safetensors").stat().st_mtime
    assert remove_stale_staging(tmp_path, now=newest + STALE_STAGING_S / 2) == []
    assert sorted(remove_stale_staging(tmp_path, now=newest + STALE_STAGING_S + 1)) == sorted([other, unnamed])
    assert not other.exists() and not unnamed.exists()


class _Tokenizer:
    def save_pretrained(self, folder):
        (folder / "tokenizer.json").write_text("{}")


def test_a_crashed_staging_folder_goes_when_a_verified_export_is_read(tmp_path):
    """Left open from issue 79's notes: the leftovers were removed only by the next export; a run reading a valid
    export (the usual case) kept a crashed one's 15 GB for good."""
    from grpo_mega.checkpoint.mcore_checkpoint import INFO_FILE
    from grpo_mega.checkpoint.source import ModelSource
    from prm.export import _publish, export_folder, hf_folder_for_vllm

    folder = tmp_path / "prm_mcore"
    folder.mkdir()
    (folder / INFO_FILE).write_text('{"format": "grpo_mega.mcore_model", "version": 1}')
    source = ModelSource(folder, "mcore_model", folder, None, None, None)
    _publish(source, _Tokenizer(), _staging(folder, f"{_host()}-{os.getpid()}-published"), export_folder(source))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    crashed = _staging(folder, f"{_host()}-{gone.pid}-0a1b2c3d")
    assert hf_folder_for_vllm(source, _Tokenizer()) == export_folder(source)  # verified: read, not exported again
    assert not crashed.exists() and export_folder(source).is_dir()
