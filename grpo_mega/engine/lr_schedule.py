"""The learning-rate schedule both training engines use: megatron's ``OptimizerParamScheduler`` over the optimizer,
counted in trainer steps, and its restore on resume (position from the checkpoint, settings from the config), with
the optimizer's own hyperparameters kept from the config the same way."""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

# Schedule settings compared on resume (the position, num_steps, is restored; these come from the config).
SCHEDULE_SETTINGS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd")
# Parameter-group entries the schedule sets at every step: not compared by ``keep_optimizer_settings``.
SCHEDULED_GROUP_KEYS = ("lr", "weight_decay", "max_lr", "min_lr")
# Parameter-group entries the optimizer itself advances at every step: state, not settings, so a resume keeps the
# checkpoint's. Transformer Engine's and apex's FusedAdam keep their bias-correction counter there (``step``, +1 per
# ``optimizer.step()``; megatron's DistributedOptimizer saves it from the groups "for TE FusedAdam support"); torch's
# Adam keeps it per parameter instead, where megatron's load puts the saved one.
OPTIMIZER_COUNTERS = ("step",)
# Which of torch's Adam kernels runs (grpo_mega.engine.fused_adam): this machine's choice, not a hyperparameter. Put
# back like the settings, never reported as a change (a checkpoint written on another device or version differs).
KERNEL_CHOICES = ("fused", "foreach")


def build_lr_schedule(optimizer, optim, total_steps: int) -> OptimizerParamScheduler:
    """Warm-up then ``optim.decay_style`` decay over ``total_steps`` trainer steps, constant weight decay (scaled
    per parameter group by its ``wd_mult``); ``optim`` is ``grpo_mega.config.OptimConfig``."""
    warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )


def restore_lr_schedule(scheduler: OptimizerParamScheduler, saved: dict, position: int | None) -> list[str]:
    """Move ``scheduler`` to ``position`` (default: the saved ``num_steps``) keeping its own settings (from the
    current config); returns the settings that differ from ``saved``, e.g. ``["lr_decay_steps 2 -> 4"]``."""
    current = scheduler.state_dict()
    changes = [f"{name} {saved[name]} -> {current[name]}" for name in SCHEDULE_SETTINGS
               if name in saved and saved[name] != current[name]]
    scheduler.num_steps = int(saved["num_steps"] if position is None else position)
    scheduler.step(increment=0)  # sets every param group's lr / weight decay at that position
    return changes


def optimizer_settings(optimizer) -> list[dict]:
    """Each parameter group's hyperparameters (betas, eps, wd_mult, ...), without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def keep_optimizer_settings(optimizer, built: list[dict]) -> list[str]:
    """After loading a checkpoint's optimizer state, put back the hyperparameters ``built`` (``optimizer_settings``
    taken before the load, i.e. from the current config); returns those the checkpoint had otherwise, as
    ``"name old -> new"`` (lr and weight decay are the schedule's: see ``restore_lr_schedule``). The optimizer's
    counters (``OPTIMIZER_COUNTERS``) are the checkpoint's: a fresh optimizer's are never put back nor reported."""
    groups = optimizer.param_groups
    if len(groups) != len(built):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this model {len(built)}")
    changes: dict[str, str] = {}
    for group, settings in zip(groups, built):
        for name, value in settings.items():
            if name in OPTIMIZER_COUNTERS:
                continue
            if name not in SCHEDULED_GROUP_KEYS + KERNEL_CHOICES and not _same_setting(group.get(name), value):
                changes.setdefault(name, f"{name} {group.get(name)} -> {value}")
            group[name] = value
    return list(changes.values())


def _same_setting(saved, current) -> bool:
    """Equal, a saved list and a current tuple of the same values included (betas after a YAML round trip)."""
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        return list(saved) == list(current)
    return saved == current
