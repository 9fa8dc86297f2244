"""The run folder guard: a run folder (``trainer.run_dir``) holds one run, never two mixed.

Checked in the command's own process before any rank starts (and again on rank 0 when the run starts, by the run
harness), from the resolved config as a plain dict (its ``trainer`` section: ``run_dir``, ``resume``,
``total_steps``, ``overwrite``, ``resume_with_changes``):

- a run folder the run cannot write (a file, read-only, a full disk: ``grpo_mega.run.writable``) is refused;
- a folder that holds an earlier run (``config.yaml``, ``metrics.jsonl`` or a checkpoint) is refused with
  ``trainer.resume=none`` unless ``trainer.overwrite=true``, which moves it aside whole to
  ``<run_dir>.old-<time>`` (nothing is deleted);
- ``trainer.resume=auto`` (the default) continues the same run: one whose config differs in a setting that changes
  what is trained (:data:`IDENTITY_KEYS`: the model and its LoRA adapters, the data, the rewards and process
  supervision, KL) or what a step is (:data:`STEP_KEYS`: the group size, the rollout batch, the updates per step)
  is refused in one line naming
  every such key, unless ``trainer.allow_config_change`` names it (or ``trainer.resume_with_changes=true`` allows
  them all); the learning rate, the step count, the layout and the rest may change (the run harness lists every
  change on resume and keeps each config: ``grpo_mega.run.config_history``);
- a run whose newest checkpoint is at ``trainer.total_steps`` is complete: :func:`check_run_folder` says so
  (:class:`RunFolderVerdict`) and the command exits 0 without starting anything.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_mega.run.checkpoints import checksum_problem, newest_complete, recorded_checksums, step_dirs
from grpo_mega.run.layout import CHECKPOINTS_DIR, CONFIG_FILE, METRICS_FILE, STATE_FILE
from grpo_mega.run.writable import run_dir_problem

IDENTITY_KEYS = ("engine", "model.hf_config", "model.tokenizer", "model.lora.", "data.", "reward.",
                 "process_reward.", "prm.", "algorithm.supervision", "algorithm.step_credit", "algorithm.use_kl_loss",
                 "algorithm.kl_loss_coef", "algorithm.kl_estimator")
"""The settings that change what a run trains (a dotted key, or a section with its dot): a resumed run keeps them."""
STEP_KEYS = ("algorithm.rollout_batch_size", "algorithm.num_return_sequences_in_group", "algorithm.ppo_epochs",
             "algorithm.mini_batch_size", "tree_rollout.branching", "trainer.batch_size")
"""The settings that change what one step is: its prompts (the rollout batch: also the data position a resumed run
continues from) and samples per prompt (G, or the tree's shape: the group its advantages are normalised over), the
optimizer steps it takes (epochs, mini-batches), SFT / PRM training's examples per step. Steps before and after such
a change are not the same unit, so the metrics curve, ``total_steps`` and the schedule would no longer mean what
they did: a resumed run keeps them too, unless ``trainer.allow_config_change`` names them."""
GUARDED_KEYS = IDENTITY_KEYS + STEP_KEYS
ADAPTER_SHAPE_KEYS = ("model.lora.rank", "model.lora.target_modules")
"""The guarded settings no allowance changes on a resume: a checkpoint's LoRA adapters (rank 0: none, the whole
model) load into adapters of their own shape only."""
ALLOW_KEY = "trainer.allow_config_change"
FREE_KEYS = ("data.eval_file", "data.eval_format", "data.max_eval_prompts", "data.on_bad_row")
"""Settings under :data:`IDENTITY_KEYS` that only evaluate or report, which a resumed run may change."""


EQUIVALENT = {"data.chat_template": (False, None)}
"""Values of one setting that train the same: a run saved before ``data.chat_template`` defaulted to null saved
false, and both render prompt texts without the chat template (conversations needed true then)."""


class RunFolderError(ValueError):
    """The run folder holds another run (or this run with other settings); the message names the fix."""


@dataclass(frozen=True)
class RunFolderVerdict:
    """What the guard found: ``complete`` (``checkpoint`` is at ``trainer.total_steps``: nothing to do, said in
    ``message``), ``moved_to`` (where ``trainer.overwrite`` moved the earlier run)."""

    complete: bool = False
    message: str = ""
    moved_to: Path | None = None
    checkpoint: Path | None = None


def earlier_run(run_dir: Path) -> list[str]:
    """What of an earlier run ``run_dir`` holds: its config, metrics log, checkpoints (empty: none)."""
    found = [name for name in (CONFIG_FILE, METRICS_FILE) if (run_dir / name).is_file()]
    steps = step_dirs(run_dir)
    if steps:
        found.append(f"{CHECKPOINTS_DIR}/{steps[0][1].name}")
    return found


def check_run_folder(config: dict[str, Any], *, act: bool = True) -> RunFolderVerdict:
    """Check ``trainer.run_dir`` against ``config`` (the resolved run config as a dict) as the module docstring
    says; with ``act``, move an earlier run aside when ``trainer.overwrite`` asks. Raises RunFolderError."""
    trainer = config["trainer"]
    run_dir, resume = Path(trainer["run_dir"]), str(trainer["resume"])
    unwritable = run_dir_problem(run_dir)  # a file, read-only, full: before launch, not at the first save
    if unwritable:
        raise RunFolderError(unwritable)
    overwrite, allow_changes = bool(trainer.get("overwrite")), bool(trainer.get("resume_with_changes"))
    allowed = check_allowed_changes(config)
    found = earlier_run(run_dir)
    inside = resume not in ("auto", "none") and _inside(Path(resume), run_dir)
    if overwrite and resume != "none":
        raise RunFolderError(f"trainer.overwrite=true starts the run afresh, moving trainer.run_dir={run_dir} aside: "
                             f"set trainer.resume=none with it (trainer.resume={resume} continues a run)")
    if not found:
        return RunFolderVerdict()
    if resume == "none" or (resume != "auto" and not inside):
        if not overwrite:
            raise RunFolderError(
                f"trainer.run_dir={run_dir} holds an earlier run ({', '.join(found)}) and trainer.resume={resume} "
                f"would mix a new run into it: set trainer.overwrite=true (with trainer.resume=none) to move it aside "
                f"to {run_dir}.old-<time>, trainer.resume=auto to continue it, or another trainer.run_dir")
        return RunFolderVerdict(moved_to=move_aside(run_dir) if act else None)
    checkpoint = Path(resume) if inside else newest_readable(run_dir)
    previous = _saved_config(checkpoint / CONFIG_FILE if checkpoint is not None else run_dir / CONFIG_FILE)
    changed = [] if previous is None else changed_identity(previous, config, run_dir)
    reshaped = [change for change in changed if change[0] in ADAPTER_SHAPE_KEYS]
    if reshaped:
        shown = "; ".join(f"{key}: {show_value(old)} -> {show_value(new)}" for key, old, new in reshaped)
        raise RunFolderError(
            f"trainer.run_dir={run_dir} holds a run with other LoRA adapters ({shown}): its checkpoint loads into "
            f"adapters of its own shape only (rank 0: none); set model.lora as the run had it, or "
            f"trainer.resume=none trainer.overwrite=true to move it aside and start again, or another trainer.run_dir")
    refused = [] if allow_changes else [change for change in changed if not _allowed(change[0], allowed)]
    if refused:
        shown = "; ".join(f"{key}: {show_value(old)} -> {show_value(new)}" for key, old, new in refused)
        names = ",".join(key for key, *_ in refused)
        raise RunFolderError(
            f"trainer.run_dir={run_dir} holds a run trained with other settings ({shown}): resuming it would change "
            f"what it trains or what a step is; name them to continue it so ({ALLOW_KEY}=[{names}]; "
            f"trainer.resume_with_changes=true allows any), or trainer.resume=none trainer.overwrite=true to move it "
            f"aside and start again, or another trainer.run_dir")
    step = _step_of(checkpoint)
    if step is not None and step >= int(trainer["total_steps"]):
        return RunFolderVerdict(complete=True, checkpoint=checkpoint, message=(
            f"{run_dir} is complete: its checkpoint {checkpoint.name} is at trainer.total_steps="
            f"{trainer['total_steps']}; nothing to do (raise trainer.total_steps to train on)"))
    return RunFolderVerdict()


def newest_readable(run_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume=auto`` resumes from, as far as this process reads it: the newest complete one
    whose config and trainer state (the files read here) match the checksums its ``complete.json`` records. An
    altered one is passed over as the ranks pass it over (they verify every file before loading, say which, and may
    fall back further); reading its config instead failed the command with a decoding traceback on every restart
    (bench/chaos.py: a config.yaml with one byte flipped)."""
    refused: list[Path] = []
    while (checkpoint := newest_complete(run_dir, skip=refused)) is not None:
        recorded = recorded_checksums(checkpoint) or {}
        if checksum_problem(checkpoint, [name for name in (CONFIG_FILE, STATE_FILE) if name in recorded]) is None:
            return checkpoint
        refused.append(checkpoint)
    return None


def check_allowed_changes(config: dict[str, Any]) -> list[str]:
    """The entries of ``trainer.allow_config_change`` (dotted keys or sections, a trailing dot optional); raises
    RunFolderError for one that is no setting of ``config`` or that the guard never refuses (a typo would else
    allow nothing and say nothing)."""
    entries = config["trainer"].get("allow_config_change") or []
    if not isinstance(entries, list):
        raise RunFolderError(f"{ALLOW_KEY}={entries!r} must be a list of dotted keys, e.g. "
                             f"{ALLOW_KEY}=[algorithm.num_return_sequences_in_group]")
    keys = set(flatten_config(config))
    found = []
    for entry in entries:
        name = str(entry).rstrip(".")
        covered = [key for key in keys if key == name or key.startswith(name + ".")]
        if not covered:
            raise RunFolderError(f"{ALLOW_KEY}: {entry!r} is no setting of this config (a dotted key such as "
                                 f"algorithm.num_return_sequences_in_group, or a section such as reward)")
        if not any(_guarded(key) for key in covered):
            raise RunFolderError(f"{ALLOW_KEY}: {entry!r} may change on resume without being named (only the "
                                 f"settings that change what is trained or what a step is need naming: "
                                 f"{', '.join(name.rstrip('.') for name in GUARDED_KEYS)})")
        found.append(name)
    return found


def _allowed(key: str, allowed: list[str]) -> bool:
    return any(key == name or key.startswith(name + ".") for name in allowed)


def _guarded(key: str) -> bool:
    return (any(key == name or (name.endswith(".") and key.startswith(name)) for name in GUARDED_KEYS)
            and key not in FREE_KEYS)


def changed_identity(previous: dict, current: dict, run_dir: Path) -> list[tuple[str, Any, Any]]:
    """(key, previous value, current value) of every :data:`GUARDED_KEYS` setting that differs; a key the previous
    config lacks (a setting added since that run started, whose default keeps the behaviour it had) is not compared,
    nor two values :data:`EQUIVALENT` names. An unset
    ``model.tokenizer`` is ``model.hf_config``'s; a previous value that is a path inside ``run_dir`` was derived by
    the run itself (a PRM's config written beside its checkpoints) and is not compared."""
    old, new = flatten_config(previous), flatten_config(current)
    for flat in (old, new):
        if flat.get("model.tokenizer") is None:
            flat["model.tokenizer"] = flat.get("model.hf_config")
    lora_off = not old.get("model.lora.rank") and not new.get("model.lora.rank")  # its settings apply to nothing
    keys = sorted(key for key in set(old) | set(new)
                  if _guarded(key) and not (lora_off and key.startswith("model.lora."))
                  and not (isinstance(old.get(key), str) and "/" in old[key] and _inside(Path(old[key]), run_dir)))
    return [(key, old.get(key), new.get(key)) for key in keys
            if key in old and not _same(old.get(key), new.get(key)) and not _equivalent(key, old[key], new.get(key))]


def move_aside(run_dir: Path) -> Path:
    """Rename ``run_dir`` to ``<run_dir>.old-<YYYYmmdd-HHMMSS>`` (a free name); returns it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    index = 1
    while target.exists():
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{index}")
        index += 1
    os.rename(run_dir, target)
    return target


def _saved_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: not UTF-8 (an old checkpoint without checksums)
        return None
    return loaded if isinstance(loaded, dict) else None


def _step_of(checkpoint: Path | None) -> int | None:
    if checkpoint is None:
        return None
    name = checkpoint.name
    return int(name.split("_", 1)[1]) if name.startswith("step_") and name[5:].isdigit() else None


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def flatten_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """A config dict as {dotted key: value} (lists are values)."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten_config(value, f"{prefix}{key}."))
    return flat


def _same(old: Any, new: Any) -> bool:
    """Equal, or two spellings of one existing path (relative and absolute)."""
    if old == new:
        return True
    if isinstance(old, str) and isinstance(new, str) and os.path.exists(old) and os.path.exists(new):
        return os.path.samefile(old, new)
    return False


def _equivalent(key: str, old: Any, new: Any) -> bool:
    values = EQUIVALENT.get(key, ())
    return old in values and new in values


def show_value(value: Any) -> str:
    """A setting's value for a message: strings quoted, at most 60 characters."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
