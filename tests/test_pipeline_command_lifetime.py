"""A command a pipeline runs (``grpo_mega.run.commands.run_command``: ``grpo-mega quickstart``'s,
``bench/pipeline_seeds.py``'s) never outlives the pipeline. Issue 79: SIGTERM (or Ctrl-C) to the pipeline left its
running ``train`` (``grpo_mega.run.torchrun`` and its fork servers) training on with parent 1. A 2-rank tiny
``train`` runs under a one-line pipeline; once its steps run, the pipeline gets SIGTERM (it stops the command and
waits for it) or SIGKILL (the kernel ends the command, which takes its fork server and ranks with it); 5 s after the
pipeline ended, no process of its command is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tiny_task import build_tiny_task, tiny_run_overrides

from grpo_mega.run.procfs import processes_left_after, processes_started_with
from grpo_mega.run.shared_fork_server import SHARED_FORK_SERVER_ENV

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
TAG_ENV = "GRPO_MEGA_TEST_PIPELINE_TAG"
PIPELINE = ("import sys; from pathlib import Path; from grpo_mega.run.commands import run_command; "
            "run_command(sys.argv[2:], Path(sys.argv[1]), show=False)")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_process_of_a_pipelines_command_outlives_the_pipeline(task, tmp_path, ending):
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    environment = {key: value for key, value in os.environ.items() if key != SHARED_FORK_SERVER_ENV}  # own server
    environment.update({TAG_ENV: tag, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    command = ["train", "--config", str(CONFIG), "--nproc", "2",
               *tiny_run_overrides(task, run_dir, "parallel.tensor=1", "trainer.total_steps=1000",
                                   "trainer.save_every=0", "trainer.eval_every=0")]
    pipeline = subprocess.Popen([sys.executable, "-c", PIPELINE, str(tmp_path / "train.log"), *command],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                                cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # imports and the model build first: a minute on a loaded 2-core machine
        metrics = run_dir / "metrics.jsonl"
        while pipeline.poll() is None and time.monotonic() < deadline and not (
                metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.5)
        assert pipeline.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
        assert metrics.exists(), "no step ran in 300 s"
        running = processes_started_with(TAG_ENV, tag)
        assert len(running) >= 4, running  # the pipeline, the command, its fork server, its ranks
        pipeline.send_signal(ending)
        pipeline.communicate(timeout=120)
        left = processes_left_after(TAG_ENV, tag, 5.0)
        assert not left, f"left 5 s after the pipeline ended: {left}"
        # SIGTERM: the pipeline stopped its command and waited for it, then exited 128 + SIGTERM
        assert pipeline.returncode == (128 + signal.SIGTERM if ending == signal.SIGTERM else -signal.SIGKILL)
    finally:
        processes_left_after(TAG_ENV, tag, 0)  # a failed check: leave nothing behind for the next test
        if pipeline.poll() is None:
            pipeline.kill()
            pipeline.wait()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows and rows[0]["step"] == 1
