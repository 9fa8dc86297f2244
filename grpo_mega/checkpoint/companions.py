"""A second training engine saved in a training checkpoint beside the run's own (e.g. the implicit PRM of
``process_reward.source: implicit``): its model, optimizer and learning-rate schedule in a subfolder of the step
folder, ``step_N/<name>/``, written while the checkpoint is staged, so ``complete.json`` lists its files and a
checkpoint is complete with its companions or not at all.

The subfolder is a megatron ``dist_checkpointing`` folder (global shapes: it loads at any TP / PP / DP) whose common
state holds the schedule and ``companion``: the optimizer steps taken and whether the optimizer state is there. RNG
states are the checkpoint's (every rank's generators are shared by all its engines). The companion must be resumed
with the same ``parallel.distributed_optimizer`` setting it was saved with.
"""

from __future__ import annotations

from pathlib import Path

from megatron.core import dist_checkpointing

from grpo_mega.checkpoint.collective import rank0_decides
from grpo_mega.checkpoint.extra_state import load_sharded
from grpo_mega.checkpoint.write_results import keep_write_results_in_process

COMPANION_KEY = "companion"


def _sharded_state(engine, *, with_optimizer: bool, is_loading: bool) -> dict:
    model = engine.model_sharded_state_dict()
    state = {"model": model}
    if with_optimizer:
        state["optimizer"] = engine.optimizer_sharded_state_dict(model, is_loading=is_loading)
    return state


def save_companion(engine, folder: Path) -> None:
    """Write ``engine`` (model, optimizer once it has stepped, schedule) into ``folder``; collective."""
    rank0_decides(lambda: folder.mkdir(parents=True, exist_ok=False))
    with_optimizer = engine.steps_done > 0
    state = _sharded_state(engine, with_optimizer=with_optimizer, is_loading=False)
    state["scheduler"] = engine.schedule_state_dict()
    state[COMPANION_KEY] = {"optimizer_steps": int(engine.steps_done), "has_optimizer": with_optimizer,
                            "distributed_optimizer": bool(getattr(engine, "distributed_optimizer", False))}
    keep_write_results_in_process()
    dist_checkpointing.save(state, str(folder))


def load_companion(engine, folder: Path, name: str) -> None:
    """Restore ``engine`` from ``folder`` (written by :func:`save_companion`); collective. ValueError naming the
    checkpoint when it has no such companion (saved by a run without it) or another optimizer sharding."""
    if not rank0_decides(lambda: (folder / "metadata.json").is_file()):
        raise ValueError(f"{folder.parent} holds no {name!r} (no {folder.name}/ folder): it was saved by a run "
                         f"without it; start a new run from its weights with model.init_from={folder.parent}")
    common = dist_checkpointing.load_common_state_dict(str(folder))
    info = common[COMPANION_KEY]
    distributed = bool(getattr(engine, "distributed_optimizer", False))
    if info["has_optimizer"] and info["distributed_optimizer"] != distributed:
        raise ValueError(f"{folder}: {name} was saved with parallel.distributed_optimizer="
                         f"{str(info['distributed_optimizer']).lower()}; resume it with the same setting")
    template = _sharded_state(engine, with_optimizer=info["has_optimizer"], is_loading=True)
    loaded = load_sharded(template, folder)
    engine.load_model_state_dict(loaded["model"])
    if info["has_optimizer"]:
        engine.load_optimizer_state_dict(loaded["optimizer"])
    else:
        engine.reload_after_weight_load()
    engine.steps_done = info["optimizer_steps"]
    engine.restore_schedule(common["scheduler"])
