"""Every config a run has used, kept beside its steps, and the one block a resume logs of what changed.

A resumed run may change settings (the learning rate, ``trainer.total_steps``, the layout, or a guarded one that
``trainer.allow_config_change`` names: ``grpo_mega.run.folder``). ``run_dir/config.yaml`` is the current config
and each checkpoint holds its own, but ``trainer.keep_last`` deletes old checkpoints: so rank 0 keeps each config
the run started or resumed with as ``run_dir/configs/config.step-<N>.yaml``, N the step it took over after (0 for
the start), never deleted. Steps ``N + 1`` up to the next file's N ran with it. A resume whose config equals its
checkpoint's writes nothing; one that differs logs every changed key, old -> new, in one block. A run begun before
this folder was kept gets its checkpoint's config recorded as step 0 at its first resume (the config its last steps
ran with; earlier ones are not known).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from grpo_mega.run.folder import flatten_config, show_value
from grpo_mega.run.layout import CONFIGS_DIR

logger = logging.getLogger(__name__)


def history_path(run_dir: str | os.PathLike, step: int) -> Path:
    """``run_dir/configs/config.step-<step>.yaml``: the config the run used from after ``step`` on."""
    return Path(run_dir) / CONFIGS_DIR / f"config.step-{step}.yaml"


def config_changes(previous: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, previous value, current value) of every setting both configs have that differs, by key (a
    setting added or removed since the previous config was written is not a change of this run's)."""
    old, new = flatten_config(previous), flatten_config(current)
    return [(key, old[key], new[key]) for key in sorted(set(old) & set(new)) if old[key] != new[key]]


def changes_block(checkpoint: Path, changes: list[tuple[str, Any, Any]], recorded: Path) -> str:
    """The block a resume logs: a title line, then one ``key: old -> new`` line per change."""
    lines = [f"resuming {checkpoint} with {len(changes)} changed setting{'s' if len(changes) != 1 else ''} "
             f"(recorded in {recorded}):"]
    lines += [f"  {key}: {show_value(old)} -> {show_value(new)}" for key, old, new in changes]
    return "\n".join(lines)


def record_config(run_dir: str | os.PathLike, config: dict, *, step: int = 0, previous: dict | None = None,
                  checkpoint: Path | None = None) -> Path | None:
    """Keep ``config`` in the run's config history (rank 0): a new run (``previous`` None) as step 0; a resume
    after ``step`` from ``checkpoint``, whose config was ``previous``, when they differ, logging the changes in one
    block. Returns the file written, or None."""
    if previous is None:
        return _write(history_path(run_dir, 0), config)
    if not any((Path(run_dir) / CONFIGS_DIR).glob("config.step-*.yaml")):
        _write(history_path(run_dir, 0), previous,
               header=f"# the config of checkpoint {checkpoint}, recorded at the first resume of a run begun before "
                      "run_dir/configs/ was kept (its earlier settings are not known)\n")
    changes = config_changes(previous, config)
    target = history_path(run_dir, step)
    if not changes:
        # an earlier attempt resumed from this step with other settings and stopped before saving: the steps after
        # it run with this config again
        if target.is_file() and step > 0 and _read(target) != config:
            _write(target, config)
        return None
    _write(target, config)
    logger.info("%s", changes_block(checkpoint or Path(run_dir), changes, target))
    return target


def _write(path: Path, config: dict, header: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(header + yaml.safe_dump(config, sort_keys=False))
    os.replace(staging, path)
    return path


def _read(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
