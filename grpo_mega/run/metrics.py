"""Metrics of a run: one jsonl line per step, TensorBoard scalars, Weights & Biases, and the progress bar or a line
per step (rank 0 only, ``grpo_mega.run.progress``). ``trainer.loggers`` picks the sinks (as verl's
``trainer.logger``); every sink gets the same metric names."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpo_mega.run.layout import TENSORBOARD_DIR, metrics_path
from grpo_mega.run.progress import StepProgress

logger = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id"
"""In ``run_dir``: the W&B run id, so a resumed run logs on into the same W&B run."""


def logger_options(cfg: Any) -> dict[str, Any]:
    """The ``MetricsLogger`` keyword arguments of a run config (GRPO, SFT or PRM): its ``trainer.loggers`` and W&B
    settings, and the whole config for W&B's run config."""
    trainer = cfg.trainer
    return {"tensorboard": trainer.tensorboard, "loggers": tuple(trainer.loggers), "wandb_project": trainer.wandb_project,
            "wandb_mode": trainer.wandb_mode, "config": asdict(cfg) if is_dataclass(cfg) else dict(cfg)}


def wandb_mode(setting: str) -> str:
    """``online`` / ``offline`` for ``trainer.wandb_mode``; ``auto``: ``WANDB_MODE`` when set, else online only when
    an API key is in the environment (no key, or a cluster without network: offline, synced later)."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def start_wandb(run_dir: Path, *, project: str, mode: str, config: dict | None):
    """A W&B run for ``run_dir`` (files under ``run_dir/wandb``), resumed when the run directory had one."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
    id_file.write_text(run_id + "\n")
    resolved = wandb_mode(mode)
    run = wandb.init(project=project, name=run_dir.resolve().name, id=run_id, resume="allow", dir=str(run_dir),
                     config=config, mode=resolved, settings=wandb.Settings(silent=True))
    if resolved == "offline":
        logger.info("W&B run %s is offline under %s; upload it with: wandb sync %s", run_id, run_dir / "wandb",
                    Path(run.dir).parent)
    return run


class MetricsLogger:
    """Writes ``metrics.jsonl`` in ``run_dir`` (appending, so a resumed run continues the file; rows of steps after
    ``start_step``, logged by a job that died before saving them, are dropped first, so every step has one row),
    and with ``loggers`` TensorBoard events under ``run_dir/tensorboard`` and a W&B run (``config`` as its run
    config); a tqdm bar (``progress_bar``) or a line per step shows the step and the ``shown`` figures (label ->
    metric name). Inactive off rank 0."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        active: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
        shown: Mapping[str, str] | None = None,
        loggers: Sequence[str] = ("jsonl", "tensorboard"),
        config: dict | None = None,
        wandb_project: str = "grpo-mega",
        wandb_mode: str = "auto",
    ):
        self.active = active
        self.writer = self.progress = self.wandb = None
        if not active:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_path(run_dir)
        drop_rows_after(self.path, start_step)
        self.file = self.path.open("a", encoding="utf-8")
        if "wandb" in loggers:
            self.wandb = start_wandb(run_dir, project=wandb_project, mode=wandb_mode, config=config)
        if tensorboard and "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))
        self.progress = StepProgress(total_steps=total_steps, start_step=start_step, shown=shown or {},
                                     bar=progress_bar)
        self.started = time.time()

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """Record the metrics of ``step``; ``advance=False`` for records that are not a training step
        (the evaluation before the first step)."""
        if not self.active:
            return
        # Non-finite values are kept (JSON ``NaN`` / ``Infinity``): a diverging run must show it, not hide it.
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self.file.write(json.dumps({"step": step, "time": time.time() - self.started, **clean}) + "\n")
        self.file.flush()
        if self.writer is not None:
            for name, value in clean.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        self.progress.record(step, clean, advance=advance)

    def close(self) -> None:
        if not self.active:
            return
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            # Wait until W&B's service has written (offline) or sent everything and stop it: its atexit hook is not
            # reliable in processes started by multiprocessing / torchrun (wandb.teardown's docstring), and a
            # resumed run's records were once missing from the offline file right after finish() under load.
            import wandb

            wandb.teardown()
        self.file.close()


def drop_rows_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the rows of steps after ``step``; nothing to do when there are none."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or int(json.loads(line)["step"]) <= step]
    if len(kept) == len(lines):
        return
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(kept), encoding="utf-8")
    staging.replace(path)


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a ``metrics.jsonl``; a resumed run's repeated steps keep their last record."""
    rows: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    return [rows[step] for step in sorted(rows)]
