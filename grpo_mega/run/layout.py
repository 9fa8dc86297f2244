"""The names of a run folder's contents, for every reader and writer of it: the trainers, the checkpoint layer,
the pipelines (quickstart, PRM) and the tools. Nothing here imports torch, so the light processes use it too.

Layout of a run directory (``trainer.run_dir``)::

  <run_dir>/config.yaml                  the run config, as the run resolved it
  <run_dir>/configs/config.step-0.yaml   every config the run used, from after that step on
                                         (``grpo_mega.run.config_history``; never deleted)
  <run_dir>/metrics.jsonl                one row per step (``grpo_mega.run.metrics``)
  <run_dir>/tensorboard/                 TensorBoard events, when enabled
  <run_dir>/failure.json                 what ended the last attempt that failed (``grpo_mega.run.failure``)
  <run_dir>/tracebacks/rank3.txt         the tracebacks of rank 3's failures, one after the other
  <run_dir>/rollouts/step_000042.jsonl   the step's trained completions (``trainer.dump_rollouts``)
  <run_dir>/checkpoints/step_000042/     one complete training checkpoint (``grpo_mega.checkpoint.training_files``)
      grpo_mega_checkpoint.json          what this is: step, optimizer steps, the TP/PP/DP it was saved at
      config.yaml                        the run config
      complete.json                      written last: the step and every file with its size
  <run_dir>/checkpoints/latest           name of the newest complete checkpoint (replaced atomically)
  <run_dir>/checkpoints/.tmp-*           a save in progress, or left by a crash: never loaded
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CONFIG_FILE = "config.yaml"
CONFIGS_DIR = "configs"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
FAILURE_FILE = "failure.json"
TRACEBACKS_DIR = "tracebacks"
ROLLOUTS_DIR = "rollouts"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "grpo_mega_checkpoint.json"
COMPLETE_FILE = "complete.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """Name of the checkpoint folder (and the per-step files) of ``step``: ``step_000042`` (more digits past
    999999)."""
    return f"step_{step:06d}"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """``<run_dir>/checkpoints/step_N``: where a run's checkpoint of ``step`` is published."""
    return Path(run_dir) / CHECKPOINTS_DIR / step_dir_name(step)


def metrics_path(run_dir: str | os.PathLike) -> Path:
    """``<run_dir>/metrics.jsonl``."""
    return Path(run_dir) / METRICS_FILE
