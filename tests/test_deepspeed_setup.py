"""The stale DeepSpeed build-lock warning: a lock left by a killed op build would hang every later DeepSpeed job."""

import logging
import os
import time

from grpo_mega.engine.deepspeed_setup import STALE_LOCK_SECONDS, warn_stale_build_locks


def _lock(root, op, age_seconds):
    lock = root / "py311_cpu" / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    stamp = time.time() - age_seconds
    os.utime(lock, (stamp, stamp))
    return lock


def test_old_lock_is_named_and_fresh_lock_is_left_alone(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = _lock(tmp_path, "deepspeed_shm_comm", STALE_LOCK_SECONDS + 120)
    _lock(tmp_path, "deepspeed_cpu_adam", 30)  # a build running now
    _lock(tmp_path, "someone_elses_op", STALE_LOCK_SECONDS + 120)  # not DeepSpeed's
    with caplog.at_level(logging.WARNING, logger="grpo_mega.engine.deepspeed_setup"):
        stale = warn_stale_build_locks()
    assert stale == [old]
    assert len(caplog.records) == 1
    assert str(old) in caplog.records[0].getMessage() and "rm " in caplog.records[0].getMessage()


def test_no_extension_folder_is_no_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "absent"))
    with caplog.at_level(logging.WARNING):
        assert warn_stale_build_locks() == []
    assert not caplog.records
