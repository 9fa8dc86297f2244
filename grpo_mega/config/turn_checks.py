"""The checks of turn credit (``process_reward.steps: turns``, ``algorithm.turn_credit``): which step-reward sources
run on the turns of multi-turn rollouts, and what is refused (each in one line, with the reason)."""

from __future__ import annotations

import math

from grpo_mega.algo.choices import MAX_TURNS_OUTCOMES, TURN_CREDIT_FORMS
from grpo_mega.config.checks import check_choice
from grpo_mega.config.loading import ConfigError
from grpo_mega.config.process import STEP_KINDS

TURN_SOURCES = ("function", "tool", "prm", "implicit", "tree")
"""The ``process_reward.source`` values that score assistant turns."""


def validate_turn_credit(cfg) -> None:
    """``process_reward.steps`` and the ``algorithm.turn_credit*`` keys; with multi-turn rollouts, process
    supervision only by turns and only from the sources that score turns."""
    alg, settings, multi_turn = cfg.algorithm, cfg.process_reward, cfg.rollout.multi_turn.enable
    check_choice(settings.steps, STEP_KINDS, "process_reward.steps")
    check_choice(alg.turn_credit, TURN_CREDIT_FORMS, "algorithm.turn_credit")
    check_choice(alg.max_turns_outcome, MAX_TURNS_OUTCOMES, "algorithm.max_turns_outcome")
    if not 0.0 < alg.turn_credit_bound < 0.5:
        raise ConfigError(f"algorithm.turn_credit_bound={alg.turn_credit_bound} must lie in (0, 0.5) (a turn's factor "
                          "1 + m stays in [1 - 2b, 1 + 2b], positive)")
    if not (alg.turn_credit_weight >= 0 and math.isfinite(alg.turn_credit_weight)):
        raise ConfigError(f"algorithm.turn_credit_weight={alg.turn_credit_weight} must be finite and >= 0")
    for key in ("tool_error_reward", "tool_success_reward", "tool_void_turn_reward"):
        if not math.isfinite(getattr(settings, key)):
            raise ConfigError(f"process_reward.{key}={getattr(settings, key)} must be finite")
    if not math.isfinite(alg.wrong_answer_reward):
        raise ConfigError(f"algorithm.wrong_answer_reward={alg.wrong_answer_reward} must be finite")
    if settings.source == "tool" and settings.steps != "turns":
        raise ConfigError("process_reward.source=tool scores assistant turns by their tool calls: it needs "
                          "process_reward.steps=turns (and rollout.multi_turn.enable=true)")
    if settings.steps == "turns" and not multi_turn:
        raise ConfigError("process_reward.steps=turns makes each assistant turn a step: it needs "
                          "rollout.multi_turn.enable=true (a single-turn response has one turn)")
    if settings.steps == "turns" and alg.supervision != "process":
        raise ConfigError("process_reward.steps=turns gives step rewards: it needs algorithm.supervision=process")
    if not multi_turn or alg.supervision != "process":
        return
    if settings.steps != "turns":
        raise ConfigError("rollout.multi_turn.enable=true with algorithm.supervision=process needs "
                          "process_reward.steps=turns (text steps would cross the tool turns)")
    if settings.source not in TURN_SOURCES:
        raise ConfigError(f"process_reward.source={settings.source} with process_reward.steps=turns: use one of "
                          f"{', '.join(TURN_SOURCES)}")
    if settings.source == "implicit" and cfg.implicit_prm.steps != "text":
        raise ConfigError(f"implicit_prm.steps={cfg.implicit_prm.steps} with process_reward.steps=turns: the turns are "
                          "the steps (their model tokens' rewards summed); set implicit_prm.steps=text")
    if settings.source in ("prm", "implicit") and settings.max_counted_steps:
        raise ConfigError("process_reward.max_counted_steps merges text steps; with process_reward.steps=turns the "
                          "turns are the steps (rollout.multi_turn.max_turns caps them): set it to 0")
