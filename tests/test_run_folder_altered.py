"""The run folder guard (the command's own process, before any rank starts) reads the config of the checkpoint a
resume will load; when that checkpoint's config or trainer state was altered after its save it must pass over it as
the ranks do, not fail. Found by bench/chaos.py: one byte flipped in the newest checkpoint's config.yaml made every
restart end in a UnicodeDecodeError traceback from the guard, so the run could never fall back to the checkpoint
before it."""

from pathlib import Path

import yaml

from checkpoint_layout import write_published_checkpoint
from grpo_mega.run.folder import check_run_folder, newest_readable


def _checkpoint(run_dir: Path, step: int, config: dict) -> Path:
    """A complete published checkpoint of ``step`` with ``config`` and placeholder weights: the guard reads only
    its listing, state and config."""
    return write_published_checkpoint(run_dir, step, state={"step": step}, config_yaml=yaml.safe_dump(config))


def _flip(file: Path, text: bytes, to: bytes) -> None:
    data = file.read_bytes()
    assert text in data and len(text) == len(to)
    file.write_bytes(data.replace(text, to, 1))


def _config(run_dir: Path, train_file: str = "train.jsonl", total_steps: int = 10) -> dict:
    return {"trainer": {"run_dir": str(run_dir), "resume": "auto", "total_steps": total_steps},
            "model": {"hf_config": "tiny"}, "data": {"train_file": train_file}}


def test_an_altered_config_of_the_newest_checkpoint_is_passed_over_not_a_traceback(tmp_path):
    run_dir = tmp_path / "run"
    config = _config(run_dir)
    older, newest = _checkpoint(run_dir, 3, config), _checkpoint(run_dir, 6, config)
    assert newest_readable(run_dir) == newest
    _flip(newest / "config.yaml", b"train.jsonl", b"train\xf5jsonl")  # same size, no longer UTF-8
    assert newest_readable(run_dir) == older
    verdict = check_run_folder(_config(run_dir))
    assert not verdict.complete  # the ranks will resume from step 3 (and name step 6's file)


def test_the_settings_are_compared_with_the_checkpoint_the_resume_will_load(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 3, _config(run_dir, train_file="a.jsonl"))
    newest = _checkpoint(run_dir, 6, _config(run_dir, train_file="b.jsonl"))
    _flip(newest / "grpo_mega_checkpoint.json", b'"step"', b'"stap"')
    try:
        check_run_folder(_config(run_dir, train_file="b.jsonl"))
    except Exception as error:  # RunFolderError: step 3 was trained on a.jsonl
        assert "data.train_file: 'a.jsonl' -> 'b.jsonl'" in str(error)
    else:
        raise AssertionError("resuming step 3 with another train file was not refused")


def test_a_complete_run_whose_last_checkpoint_was_altered_is_not_called_complete(tmp_path):
    run_dir = tmp_path / "run"
    config = _config(run_dir, total_steps=6)
    _checkpoint(run_dir, 3, config)
    last = _checkpoint(run_dir, 6, config)
    assert check_run_folder(config).complete
    _flip(last / "config.yaml", b"tiny", b"tinz")
    assert not check_run_folder(config).complete
