"""Metrics of a run: one jsonl line per step, TensorBoard scalars and a progress bar (rank 0 only)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLogger:
    """Writes ``metrics.jsonl`` in ``run_dir`` (appending, so a resumed run continues the file; rows of steps after
    ``start_step``, logged by a job that died before saving them, are dropped first, so every step has one row),
    TensorBoard events under ``run_dir/tensorboard`` and a tqdm bar showing step, reward and ETA. Inactive off
    rank 0."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        active: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
        bar_metric: str = "critic/score/mean",
    ):
        self.active = active
        self.bar_metric = bar_metric
        self.writer = self.bar = None
        if not active:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        drop_rows_after(self.path, start_step)
        self.file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
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
        if self.bar is not None:
            if advance:
                self.bar.update(1)
            if math.isfinite(clean.get(self.bar_metric, math.nan)):
                self.bar.set_postfix({self.bar_metric.split("/")[-2]: f"{clean[self.bar_metric]:.3f}"})

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
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
