"""Fitting the step-time model's efficiency factors to measured seconds (``bench/step_time_cpu.py`` on this CPU,
``bench/step_time_published.py`` on published GPU runs): coordinate descent, a golden-section search of each factor
in log space within its bounds, on any loss of an :class:`Efficiency`."""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Callable

from grpo_mega.plan.step_time import Efficiency

FACTORS = tuple(f.name for f in fields(Efficiency))
"""The factors a fit moves: every field of :class:`Efficiency`."""
_GOLDEN = (math.sqrt(5) - 1) / 2


def fit_efficiency(loss: Callable[[Efficiency], float], *, bounds: dict[str, tuple[float, float]],
                   default_bounds: tuple[float, float], rounds: int, searches: int) -> Efficiency:
    """The :class:`Efficiency` that ``loss`` finds smallest, starting from the defaults: ``rounds`` passes over
    :data:`FACTORS`, each factor searched ``searches`` times in log space within ``bounds[name]`` (or
    ``default_bounds``) while the others stay fixed."""
    eff = Efficiency()
    for _ in range(rounds):
        for name in FACTORS:
            lo, hi = (math.log(b) for b in bounds.get(name, default_bounds))
            for _ in range(searches):
                x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
                if loss(replace(eff, **{name: math.exp(x1)})) < loss(replace(eff, **{name: math.exp(x2)})):
                    hi = x2
                else:
                    lo = x1
            eff = replace(eff, **{name: math.exp((lo + hi) / 2)})
    return eff
