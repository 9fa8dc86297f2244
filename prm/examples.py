"""The one in-memory form of a PRM example, whatever file format it was read from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepExample:
    """A prompt, the steps of one solution, and what is known about the steps.

    ``steps`` partition the solution text: ``"".join(steps)`` is the solution as written after the prompt (the
    rendering adds the step tag after each step, see ``prm.rendering``).
    """

    prompt: str
    steps: list[str]
    labels: list[bool] | None = None
    """Hard label of each step (True: the step is good), when known."""
    soft_labels: list[float] | None = None
    """Probability that each step is good (Monte-Carlo labels: the fraction of rollouts that reached the answer)."""
    first_error: int | None = None
    """Index of the earliest wrong step, -1 when every step is right (ProcessBench); None when unknown."""
    answer: str | None = None
    """Gold final answer of the problem, when the source has one."""
    source: str = ""
    """Where the example came from, ``file:line``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other fields a reader keeps (e.g. the synthetic task's ``true_labels`` or ``steps`` record)."""

    def __post_init__(self) -> None:
        for name in ("labels", "soft_labels"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.steps):
                raise ValueError(f"{self.source or 'StepExample'}: {len(values)} {name} for {len(self.steps)} steps")


def first_error_of(labels: list[bool]) -> int:
    """Index of the first False label, -1 when all are True."""
    return next((index for index, good in enumerate(labels) if not good), -1)
