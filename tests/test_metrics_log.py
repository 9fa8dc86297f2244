"""metrics.jsonl across a resume: a job killed after logging a step but before saving it repeats that step, and the
resumed run's log has one row per step."""

import json

from grpo_mega.run.metrics import MetricsLogger, read_metrics


def test_resuming_drops_rows_after_the_checkpointed_step(tmp_path):
    first = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress_bar=False)
    for step in (1, 2, 3):  # step 3 was logged, then the job died before its checkpoint
        first.log(step, {"loss": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, total_steps=4, start_step=2, tensorboard=False, progress_bar=False)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["loss"]) for row in lines] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [row["loss"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 30.0, 40.0]


def test_inactive_ranks_leave_the_file_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    MetricsLogger(tmp_path, total_steps=9, start_step=2, active=False).close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 5
