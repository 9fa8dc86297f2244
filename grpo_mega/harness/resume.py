"""Resume in one place: what a training checkpoint holds for each trainer, and saving and restoring it.

Every trainer's checkpoint holds its engine (model, optimizer, learning-rate schedule, RNG states: written and
checked by ``grpo_mega.checkpoint.training.CheckpointManager``) and the run config; beside them, the trainer's own
state under fixed names, each an object with ``state_dict`` / ``load_state_dict``:

=============================== ================ ==========================================================
trainer                          state            what it is
=============================== ================ ==========================================================
GRPO, ``rollout.mode: colocated`` ``prompts``        the prompt order and position (``data.prompts.PromptBatches``)
GRPO, ``rollout.mode: async``     ``rollout_feed``   the weight version and batches in flight
                                                   (``stages.rollout_feed.RolloutFeed``)
GRPO, both                       ``figures``        whether the one-time parameter / memory figures were logged
                                                   (:class:`OneTimeFigures`; optional: older checkpoints lack it)
SFT                              (none)           its batches depend only on the seed and the step
PRM training                     (none)           the same
=============================== ================ ==========================================================

``TRAINER_STATE`` is that table; :func:`trainer_state` builds a trainer's state from it (and refuses any other set
of names), :func:`restore` and :func:`save` are the only readers and writers of it, called by ``RunHarness``. A
checkpoint whose state names are another trainer's is refused with the trainer that saved it named, before any
state is loaded into the run's objects. A name in ``OPTIONAL_STATE`` came after checkpoints without it were
written: such a checkpoint still resumes, that holder left as it was built.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from grpo_mega.checkpoint.training import CheckpointManager
from grpo_mega.config import ConfigError

logger = logging.getLogger(__name__)


class StateHolder(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


TRAINER_STATE: dict[str, tuple[str, ...]] = {
    "grpo": ("prompts", "figures"),
    "grpo_async": ("rollout_feed", "figures"),
    "sft": (),
    "prm": (),
}
"""Trainer -> the names of the state its checkpoints hold beside the engine."""

OPTIONAL_STATE = frozenset({"figures"})
"""State names a checkpoint may lack (saved before they existed); their holders then keep what they were built with."""

TRAINER_TITLES = {"grpo": "GRPO with rollout.mode: colocated", "grpo_async": "GRPO with rollout.mode: async",
                  "sft": "SFT", "prm": "PRM training"}


class TrainerState(NamedTuple):
    """One trainer's state beside its engine: ``holders`` under the names ``TRAINER_STATE[trainer]``."""

    trainer: str
    holders: dict[str, StateHolder]

    def state_dicts(self) -> dict[str, Any]:
        return {name: holder.state_dict() for name, holder in self.holders.items()}


def trainer_state(trainer: str, **holders: StateHolder) -> TrainerState:
    """``trainer``'s state (a key of ``TRAINER_STATE``) from its holders, which must be exactly the table's."""
    if trainer not in TRAINER_STATE:
        raise ValueError(f"unknown trainer {trainer!r}: one of {sorted(TRAINER_STATE)}")
    if sorted(holders) != sorted(TRAINER_STATE[trainer]):
        raise ValueError(f"{trainer}'s checkpoint state is {list(TRAINER_STATE[trainer])}, given {sorted(holders)}")
    return TrainerState(trainer, dict(holders))


class OneTimeFigures:
    """Whether the run logged its one-time figures (``grpo_mega.perf.parameters``: parameters, memory), which go
    with its first update. Kept in checkpoints: a run whose steps up to its checkpoint all skipped the update (every
    group filtered) logs them after a resume, a run that logged them does not again (its rows stay the
    uninterrupted run's). ``logged`` is None until set or restored: a checkpoint saved before this flag existed."""

    def __init__(self) -> None:
        self.logged: bool | None = None

    def state_dict(self) -> dict:
        return {"logged": bool(self.logged)}

    def load_state_dict(self, state: dict) -> None:
        self.logged = bool(state["logged"])


def grpo_state(prompts: StateHolder, feed: StateHolder | None, figures: OneTimeFigures) -> TrainerState:
    """GRPO's state: the prompt order when colocated, the rollout feed (``feed`` not None) in async mode; and
    whether the one-time ``figures`` were logged."""
    if feed is None:
        return trainer_state("grpo", prompts=prompts, figures=figures)
    return trainer_state("grpo_async", rollout_feed=feed, figures=figures)


def _saver_of(names: set[str]) -> str:
    """Which trainer saves exactly ``names`` beside its engine (optional names aside), in words."""
    savers = [TRAINER_TITLES[t] for t, saved in TRAINER_STATE.items()
              if set(saved) - OPTIONAL_STATE == names - OPTIONAL_STATE]
    return " or ".join(savers) if savers else "a trainer of another version"


class Resumed(NamedTuple):
    """The checkpoint a run resumed from: its ``step``, folder and run ``config`` (as saved with it)."""

    step: int
    checkpoint: Path
    config: dict


def restore(checkpoints: CheckpointManager, engine, state: TrainerState, *, resume: str, seed: int,
            companions: dict | None = None) -> Resumed | None:
    """Load the checkpoint ``resume`` names (``trainer.resume``: auto / a path / none) into ``engine``, its
    ``companions`` (second engines saved beside it: ``grpo_mega.checkpoint.companions``) and ``state``'s holders;
    returns what it resumed from, or None when there is nothing to resume."""
    resume_from = checkpoints.find_resume(resume)
    if resume_from is None:
        return None
    loaded = checkpoints.load(engine, resume_from, seed=seed, companions=companions)
    saved = loaded.extra_state or {}
    for name in state.holders:
        if name not in saved and name not in OPTIONAL_STATE:
            raise ConfigError(  # the run's settings against its checkpoint's: cause=config, not retried
                f"{resume_from} holds no {name!r} state (it holds {sorted(saved)}): it was saved by "
                f"{_saver_of(set(saved))}, this run is {TRAINER_TITLES[state.trainer]}; continue it with its own "
                f"settings, or start a new run from its weights with model.init_from={resume_from}")
    for name, holder in state.holders.items():
        if name in saved:
            holder.load_state_dict(saved[name])
    logger.info("resumed from %s at step %d", resume_from, loaded.step)
    return Resumed(loaded.step, Path(resume_from), loaded.config)


def save(checkpoints: CheckpointManager, engine, state: TrainerState, step: int, *, config: dict,
         companions: dict | None = None) -> Path:
    """A checkpoint of ``engine``, its ``companions`` and ``state`` after ``step``, with the run ``config``."""
    return checkpoints.save(engine, step, extra_state=state.state_dicts() or None, config=config,
                            companions=companions)
