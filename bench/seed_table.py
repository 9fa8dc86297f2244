"""Results over seeds: one row per seed, then the mean, the sample standard deviation and the range."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Sequence


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the values that are not None (sd 0 for one value)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def spread(results: Sequence[dict], columns: Sequence[str]) -> dict[str, dict]:
    """{column: {mean, sd, min, max}} over the results that have the column."""
    out = {}
    for column in columns:
        values = [r.get(column) for r in results if r.get(column) is not None]
        mean, sd = mean_sd(values)
        out[column] = {"mean": mean, "sd": sd, "min": min(values, default=None), "max": max(values, default=None)}
    return out


def print_seed_table(seeds: Sequence[int], results: Sequence[dict], columns: Sequence[str], width: int = 18) -> dict:
    """Print the table; returns ``spread(results, columns)``."""
    summary = spread(results, columns)
    print(f"{'seed':>6}" + "".join(f"{c:>{width}}" for c in columns))
    for seed, result in zip(seeds, results):
        print(f"{seed:>6}" + "".join(f"{fmt(result.get(c)):>{width}}" for c in columns))
    for stat in ("mean", "sd", "min", "max"):
        print(f"{stat:>6}" + "".join(f"{fmt(summary[c][stat]):>{width}}" for c in columns))
    return summary


def report_seeds(seeds: Sequence[int], results: Sequence[dict], columns: Sequence[str], result_path: Path,
                 width: int = 18, extra: dict | None = None) -> Path:
    """Print the table, write the JSON record (machine, seeds, runs, spread, command, and ``extra``'s keys) and
    print its path last."""
    print()
    record = {"machine": platform.platform(), "processor": platform.processor(), "seeds": list(seeds),
              "runs": list(results), "spread": print_seed_table(seeds, results, columns, width),
              "command": " ".join(sys.argv), **(extra or {})}
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(record, indent=2) + "\n")
    print(result_path)
    return result_path
