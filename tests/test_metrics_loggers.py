"""``trainer.loggers`` (issue 30, item 8): jsonl, TensorBoard and Weights & Biases get the same metric names; W&B
runs offline here (no network), with the run config logged and a resumed run logging on into the same W&B run.

The offline run's records are read back from its ``.wandb`` file (W&B's LevelDB-style log of protobuf records)."""

from __future__ import annotations

import struct

import pytest

from grpo_mega.config import SFTConfig, load_config, validate_sft
from grpo_mega.run.metrics import MetricsLogger, logger_options, read_metrics

wandb = pytest.importorskip("wandb")
BLOCK = 32768  # the log's block size; a record header (crc32, length, type) never straddles two blocks


def wandb_records(path):
    """The protobuf records of a ``run-*.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    position, pending = 7, b""  # 7-byte file header: magic, version
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_history(run_dir):
    """{run id: (run config, [{metric: value} per logged step])} of the offline W&B runs under ``run_dir``."""
    import json

    runs = {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        config, rows = {}, []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                items = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({key: value for key, value in items.items() if not key.startswith("_") or key == "_step"})
        runs.setdefault(run_id, (config, []))[1].extend(rows)
    return runs


def test_wandb_offline_gets_the_jsonl_metrics_and_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # auto: no key -> offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = load_config(SFTConfig, None, ["model.hf_config=m", "data.train_file=x.jsonl", f"trainer.run_dir={run_dir}",
                                        "trainer.loggers=[jsonl,tensorboard,wandb]", "optim.lr=2e-5"], validate_sft)
    options = logger_options(cfg)
    first = MetricsLogger(run_dir, total_steps=4, progress_bar=False, **options)
    first.log(1, {"sft/nll": 2.5, "timing_s/step": 0.5})
    first.log(2, {"sft/nll": 2.0, "timing_s/step": 0.4})
    first.close()
    resumed = MetricsLogger(run_dir, total_steps=4, start_step=2, progress_bar=False, **options)
    resumed.log(3, {"sft/nll": 1.5, "timing_s/step": 0.3})
    resumed.close()

    jsonl = [{k: v for k, v in row.items() if k != "time"} for row in read_metrics(run_dir / "metrics.jsonl")]
    runs = offline_history(run_dir)
    assert len(runs) == 1, runs  # the resumed logger continued the same W&B run
    (config, rows), = runs.values()
    assert [{**{k: v for k, v in row.items() if k != "_step"}, "step": row["_step"]} for row in rows] == jsonl
    assert config["optim"]["lr"] == 2e-5 and config["trainer"]["loggers"] == ["jsonl", "tensorboard", "wandb"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_without_wandb_in_loggers_nothing_is_started(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=1, progress_bar=False, loggers=("jsonl",), config={"a": 1})
    logger.log(1, {"x": 1.0})
    logger.close()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "tensorboard").exists()
