"""Results over seeds: one row per seed, then the mean, the sample standard deviation and the range."""

from __future__ import annotations

import statistics
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
