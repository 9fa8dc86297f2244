"""Issue 79, item 3: a resume with a changed config leaves a record. A change of what a step is (here the group size
G) is refused in one line before launch unless ``trainer.allow_config_change`` names it; an allowed resume lists
every changed key in one block; each config the run used stays in ``run_dir/configs/`` whatever ``keep_last``
deletes. The commands are the ones a user types (subprocesses), on a real run of the tiny task (one process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_task import SMALL_RUN, build_tiny_task

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
ONE_PROCESS = [item for item in SMALL_RUN if not item.startswith("parallel.tensor")]
G_KEY = "algorithm.num_return_sequences_in_group"


def train(task, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    model_dir, train_file = task
    return subprocess.run(
        [sys.executable, "-m", "grpo_mega.cli", "train", "--config", GRPO, f"model.hf_config={model_dir}",
         f"data.train_file={train_file}", f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.save_every=1",
         "trainer.keep_last=1", *ONE_PROCESS, *extra],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    task = build_tiny_task(tmp_path_factory.mktemp("task"))
    folder = tmp_path_factory.mktemp("runs") / "run"
    result = train(task, folder)  # G = 2 (SMALL_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return task, folder


def test_a_new_run_records_its_config_as_step_0(run_dir):
    _, folder = run_dir
    assert sorted(path.name for path in (folder / "configs").iterdir()) == ["config.step-0.yaml"]
    recorded = yaml.safe_load((folder / "configs" / "config.step-0.yaml").read_text())
    assert recorded == yaml.safe_load((folder / "config.yaml").read_text())
    assert recorded["algorithm"]["num_return_sequences_in_group"] == 2


def test_a_changed_group_size_is_refused_in_one_line_before_launch(run_dir):
    task, folder = run_dir
    before = snapshot(folder)
    started = time.monotonic()
    result = train(task, folder, "trainer.total_steps=3", f"{G_KEY}=4", "algorithm.rollout_batch_size=2")
    seconds = time.monotonic() - started
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "algorithm.num_return_sequences_in_group: 2 -> 4" in lines[0]
    assert "algorithm.rollout_batch_size: 4 -> 2" in lines[0]
    assert f"trainer.allow_config_change=[algorithm.num_return_sequences_in_group,algorithm.rollout_batch_size]" \
        in lines[0]
    assert snapshot(folder) == before  # no rank started: nothing written, nothing deleted
    assert seconds < 15, seconds  # the command's own check: no rank, no model


def test_an_allowed_change_is_listed_in_one_block_and_every_config_stays_on_disk(run_dir):
    task, folder = run_dir
    result = train(task, folder, "trainer.total_steps=3", f"{G_KEY}=4", "optim.lr=1e-3",
                   f"trainer.allow_config_change=[{G_KEY}]")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    [title] = [index for index, line in enumerate(lines) if "changed settings" in line]
    assert lines[title].endswith(f"resuming {folder / 'checkpoints' / 'step_000002'} with 4 changed settings "
                                 f"(recorded in {folder / 'configs' / 'config.step-2.yaml'}):")
    assert lines[title + 1:title + 5] == [
        f"  {G_KEY}: 2 -> 4",
        "  optim.lr: 5e-05 -> 0.001",
        f"  trainer.allow_config_change: [] -> ['{G_KEY}']",
        "  trainer.total_steps: 2 -> 3",
    ]
    # keep_last=1 left only step 3's checkpoint; the configs of steps 1-2 and of step 3 are both kept
    assert sorted(path.name for path in (folder / "checkpoints").iterdir()) == ["latest", "step_000003"]
    history = {path.name: yaml.safe_load(path.read_text()) for path in (folder / "configs").iterdir()}
    assert sorted(history) == ["config.step-0.yaml", "config.step-2.yaml"]
    assert history["config.step-0.yaml"]["algorithm"]["num_return_sequences_in_group"] == 2
    assert history["config.step-2.yaml"]["algorithm"]["num_return_sequences_in_group"] == 4
    assert history["config.step-2.yaml"] == yaml.safe_load((folder / "config.yaml").read_text())


def test_allow_config_change_entries_are_checked():
    from grpo_mega.run.folder import RunFolderError, check_allowed_changes

    config = {"trainer": {"allow_config_change": []}, "algorithm": {"num_return_sequences_in_group": 8},
              "reward": {"function": "math_verify"}, "optim": {"lr": 1e-3}}
    for entries, expected in (([G_KEY, "reward"], [G_KEY, "reward"]), (["reward."], ["reward"])):
        config["trainer"]["allow_config_change"] = entries
        assert check_allowed_changes(config) == expected
    for entry, message in (("algorithm.num_return_sequence_in_group", "is no setting of this config"),
                           ("optim.lr", "may change on resume without being named")):
        config["trainer"]["allow_config_change"] = [entry]
        with pytest.raises(RunFolderError, match=message):
            check_allowed_changes(config)


def test_config_history_of_a_run_begun_without_one_and_of_an_abandoned_resume(tmp_path):
    from grpo_mega.run.config_history import history_path, record_config

    g2, g4 = {"algorithm": {"num_return_sequences_in_group": 2}}, {"algorithm": {"num_return_sequences_in_group": 4}}
    checkpoint = tmp_path / "checkpoints" / "step_000005"
    # a run begun before run_dir/configs/ was kept, resumed unchanged: its checkpoint's config becomes step 0's
    assert record_config(tmp_path, g2, step=5, previous=g2, checkpoint=checkpoint) is None
    assert yaml.safe_load(history_path(tmp_path, 0).read_text()) == g2
    assert "step_000005" in history_path(tmp_path, 0).read_text().splitlines()[0]  # a comment says where it came from
    # resumed after step 5 with G=4, which stopped before saving; then resumed after step 5 again with G=2
    assert record_config(tmp_path, g4, step=5, previous=g2, checkpoint=checkpoint) == history_path(tmp_path, 5)
    assert record_config(tmp_path, g2, step=5, previous=g2, checkpoint=checkpoint) is None
    assert yaml.safe_load(history_path(tmp_path, 5).read_text()) == g2  # steps 6.. run with G=2 again
    assert sorted(path.name for path in (tmp_path / "configs").iterdir()) == ["config.step-0.yaml",
                                                                             "config.step-5.yaml"]
