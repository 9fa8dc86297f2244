"""The checks of ``algorithm.policy_loss`` against the rest of the GRPO config (called by
``grpo_mega.config.cross_field.validate``): what each loss form is defined for, refused in one line before launch."""

from __future__ import annotations

import dataclasses
import logging

from grpo_mega.algo.choices import (PER_SEQUENCE_ADVANTAGE_POLICY_LOSSES, POLICY_LOSS_CLIP_KEYS,
                                   SEQUENCE_LEVEL_POLICY_LOSSES, VERL_LOSS_MODE_NAMES)
from grpo_mega.config.grpo import AlgorithmConfig
from grpo_mega.config.loading import ConfigError

logger = logging.getLogger(__name__)


def refuse_verl_loss_mode_name(alg: AlgorithmConfig) -> None:
    """verl's ``loss_mode`` names that differ from ours are refused naming ours (never taken silently)."""
    ours = VERL_LOSS_MODE_NAMES.get(alg.policy_loss)
    if ours is not None:
        raise ConfigError(f"algorithm.policy_loss={alg.policy_loss!r} is verl's loss_mode name: set "
                          f"algorithm.policy_loss={ours} (docs/migrating.md)")


def validate_policy_loss(alg: AlgorithmConfig, speaks: bool) -> None:
    """The form's aggregation, supervision and clip keys (``policy_loss`` itself is a known choice already).
    ``speaks``: this process prints warnings (rank 0)."""
    form = alg.policy_loss
    if form in SEQUENCE_LEVEL_POLICY_LOSSES and alg.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(f"algorithm.policy_loss={form} is a sequence-level loss (one ratio per sequence, a mean "
                          f"over sequences): set algorithm.loss_agg_mode=seq-mean-token-mean (got "
                          f"{alg.loss_agg_mode})")
    if form in PER_SEQUENCE_ADVANTAGE_POLICY_LOSSES and alg.supervision == "process":
        raise ConfigError(f"algorithm.policy_loss={form} needs one advantage per sequence and "
                          "algorithm.supervision=process gives each token its own: use policy_loss=gspo_token "
                          "(or cispo)")
    if form != "ppo" and alg.dual_clip_loss is not None:
        raise ConfigError(f"algorithm.dual_clip_loss applies to policy_loss=ppo; policy_loss={form} has no dual "
                          "clip: unset it")
    low_key, high_key = POLICY_LOSS_CLIP_KEYS[form]
    for key in (low_key, high_key):
        value = getattr(alg, key)
        if value is not None and not value >= 0:
            raise ConfigError(f"algorithm.{key}={value} must be >= 0")
    defaults = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig)}
    ignored = sorted({key for keys in POLICY_LOSS_CLIP_KEYS.values() for key in keys} - {low_key, high_key})
    changed = [f"{key}={getattr(alg, key)}" for key in ignored if getattr(alg, key) != defaults[key]]
    if changed and speaks:
        logger.warning("ignoring algorithm.%s: policy_loss=%s clips with algorithm.%s / %s", ", ".join(changed),
                       form, low_key, high_key)
