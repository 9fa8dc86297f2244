"""Issue 51: a run folder is never silently mixed with another run. Each case is the exact command a user types
(a subprocess), on a real run of the tiny task (2 GRPO steps, one process); a refused command changes nothing in
the folder (its listing and bytes are compared)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_runner import run_grpo_mega
from tiny_task import SMALL_RUN, build_tiny_task

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
ONE_PROCESS = [item for item in SMALL_RUN if not item.startswith("parallel.tensor")]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def train(task, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    model_dir, train_file = task
    return run_grpo_mega("train", "--config", GRPO, f"model.hf_config={model_dir}", f"data.train_file={train_file}",
                     f"trainer.run_dir={run_dir}", "trainer.total_steps=2", *ONE_PROCESS, *extra)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def finished_run(task, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    result = train(task, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    return run_dir


def assert_refused_unchanged(result, run_dir: Path, before: dict[str, bytes], *named: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) <= 3, result.stderr[-3000:]
    for text in named:
        assert text in result.stderr, (text, result.stderr)
    assert snapshot(run_dir) == before


def test_a_new_run_in_a_folder_that_holds_one_is_refused_and_nothing_changes(task, finished_run):
    before = snapshot(finished_run)
    result = train(task, finished_run, "trainer.resume=none")
    assert_refused_unchanged(result, finished_run, before, f"trainer.run_dir={finished_run} holds an earlier run",
                             "trainer.overwrite=true")


@pytest.mark.parametrize("changes, keys", [
    (["reward.function=synthetic_steps", "algorithm.supervision=process"],
     ["algorithm.supervision: 'outcome' -> 'process'", "reward.function: 'synthetic' -> 'synthetic_steps'"]),
    (["algorithm.use_kl_loss=true"], ["algorithm.use_kl_loss: False -> True"]),
    (["data.prompt_length=100"], ["data.prompt_length"]),
])
def test_resuming_with_settings_that_change_what_is_trained_is_refused_naming_them(task, finished_run, changes,
                                                                                   keys):
    before = snapshot(finished_run)
    result = train(task, finished_run, "trainer.total_steps=3", *changes)
    assert_refused_unchanged(result, finished_run, before, *keys, "trainer.resume_with_changes=true")


def test_a_finished_run_says_so_and_exits_0_and_a_learning_rate_change_stays_allowed(task, finished_run):
    before = snapshot(finished_run)
    for extra in ([], ["optim.lr=1e-3"]):
        result = train(task, finished_run, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stderr.strip() == (f"grpo-mega train: {finished_run} is complete: its checkpoint step_000002 is "
                                         "at trainer.total_steps=2; nothing to do (raise trainer.total_steps to "
                                         "train on)")
        assert snapshot(finished_run) == before


def test_overwrite_moves_the_earlier_run_aside_whole_and_starts_afresh(task, finished_run, tmp_path):
    run_dir = tmp_path / "run"
    os.rename(finished_run, run_dir)  # a copy of its own: the other cases keep theirs
    try:
        before = snapshot(run_dir)
        result = train(task, run_dir, "trainer.resume=none", "trainer.overwrite=true", "trainer.total_steps=1")
        assert result.returncode == 0, result.stderr[-3000:]
        [aside] = [path for path in tmp_path.iterdir() if path.name.startswith("run.old-")]
        assert f"moved the earlier run aside to {aside}" in result.stderr
        assert snapshot(aside) == before  # nothing deleted, nothing changed
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows if "step" in row and row.get("critic/score/mean") is not None] == [1]
        assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    finally:
        aside_runs = [path for path in tmp_path.iterdir() if path.name.startswith("run.old-")]
        os.rename(aside_runs[0] if aside_runs else run_dir, finished_run)


def test_a_new_attempt_sets_the_earlier_failure_aside_when_it_starts(task, tmp_path):
    """The first attempt failed before writing anything but failure.json; the rerun passes the checks, starts, and
    fails before start-up ends: failure.json names the rerun's cause, the earlier one is kept beside it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = {"cause": "peer_lost", "phase": "update", "step": 7}
    (run_dir / "failure.json").write_text(json.dumps(earlier))
    model_dir, train_file = task
    # every prompt over data.prompt_length: a cause only the ranks find (they tokenize; the CLI's check reads rows)
    result = run_grpo_mega("train", "--config", GRPO, f"model.hf_config={model_dir}", f"data.train_file={train_file}",
                       "data.prompt_length=1", f"trainer.run_dir={run_dir}", *ONE_PROCESS)
    assert result.returncode != 0
    [kept] = run_dir.glob("failure.*.json")
    assert json.loads(kept.read_text()) == earlier
    assert json.loads((run_dir / "failure.json").read_text())["cause"] != "peer_lost"


def test_settings_added_since_a_run_started_do_not_refuse_its_resume(tmp_path):
    """A run saved before data.format existed (and with data.chat_template false, the default then) resumes under
    today's defaults; a setting it saved and that changed is still named."""
    from grpo_mega.run.folder import changed_identity

    previous = {"data": {"train_file": "t.jsonl", "chat_template": False}, "reward": {"function": "math_verify"}}
    current = {"data": {"train_file": "t.jsonl", "chat_template": None, "format": "auto", "eval_format": None},
               "reward": {"function": "math_verify", "functions": None}}
    assert changed_identity(previous, current, tmp_path) == []
    current["data"]["chat_template"] = True
    current["reward"]["function"] = "synthetic"
    assert changed_identity(previous, current, tmp_path) == [("data.chat_template", False, True),
                                                             ("reward.function", "math_verify", "synthetic")]
