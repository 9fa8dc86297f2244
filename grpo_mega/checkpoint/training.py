"""Training checkpoints: save, and resume exactly, a run's model, optimizer, scheduler, RNG and data position.

A save writes everything into ``<run_dir>/checkpoints/.tmp-step_N`` (megatron dist_checkpointing, torch_dist
format, plus the files of ``training_files``); after every rank has finished, rank 0 writes ``complete.json``,
renames the folder to ``step_N``, replaces ``latest`` and prunes to ``keep_last``. A crash at any moment leaves
the previous checkpoint untouched and ``latest`` naming a complete checkpoint. ``complete.json`` records every
file's size and CRC-32 (each rank checksums the files it wrote, right after writing them). Resuming checks it
against the files on disk, sizes first, then content (the ranks share the reading), and never loads a checkpoint
that fails the check: ``auto`` falls back to the newest one that passes, saying so.

Model and optimizer tensors are stored with their global shapes, so a checkpoint loads at any TP / PP / DP
(the padded vocabulary is the same at every TP, see ``grpo_mega.model.config_map.padded_vocab_size``), with or
without the distributed optimizer whichever it was saved with (``grpo_mega.checkpoint.optimizer_state``).
The learning-rate schedule resumes at its saved position (in trainer steps) with the settings of the current
config, so a run can be extended (``trainer.total_steps``) or its ``optim.*`` changed on resume.
Engines are driven only through their interface (``grpo_mega.engine.base.TrainingEngine``); the DeepSpeed engine
writes its own files into the same staging folder instead (``engine.save_training_state``).
Reading only the model of a checkpoint (``model.init_from``, a PRM to score with) is ``grpo_mega.checkpoint.source``
(which checkpoint, its config) and ``grpo_mega.checkpoint.weights_only`` (its model tensors).
RNG states belong to one rank of one layout: they are restored when the layout matches, and the generators
are reseeded (with a warning) when it does not.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject

from grpo_mega.checkpoint.collective import is_distributed, is_rank0, rank0_decides
from grpo_mega.checkpoint.companions import load_companion, save_companion
from grpo_mega.checkpoint.extra_state import load_sharded
from grpo_mega.checkpoint.optimizer_state import SETTING, load_across_modes
from grpo_mega.checkpoint.rng import capture_rng_state, restore_rng_state
from grpo_mega.checkpoint.training_files import (
    FORMAT_NAME,
    FORMAT_VERSION,
    checkpoint_problem,
    fsync_dir,
    full_disk_error,
    list_files,
    read_checkpoint_state,
    write_file_atomic,
)
from grpo_mega.checkpoint.write_results import keep_write_results_in_process
from grpo_mega.checkpoint.verify import content_problem, newest_verified, written_by_this_rank
from grpo_mega.run.checkpoints import CHECKSUM_ALGORITHM, checksums_of, file_checksum, newest_complete, step_dirs
from grpo_mega.run.interrupts import ctrl_c_deferred, pause_point
from grpo_mega.run.layout import (
    CHECKPOINTS_DIR,
    COMPLETE_FILE,
    CONFIG_FILE,
    LATEST_FILE,
    STATE_FILE,
    TMP_PREFIX,
    step_dir_name,
)

logger = logging.getLogger(__name__)

_RNG_KEY = "rng_state"


class LoadedCheckpoint(NamedTuple):
    """What :meth:`CheckpointManager.load` hands back to the trainer."""

    step: int
    """The trainer step the checkpoint was saved after."""
    extra_state: dict
    """The trainer's opaque state (e.g. the data-loader position), as passed to ``save``."""
    config: dict
    """The run config saved with the checkpoint."""


# ----------------------------------------------------------------------------- collective helpers
def _engine_name(engine) -> str:
    """``megatron`` or ``deepspeed``: which engine's files a checkpoint holds."""
    return getattr(engine, "engine_name", "megatron")


def _distributed_optimizer(engine) -> bool:
    """Whether the engine's optimizer state is sharded over DP ranks (megatron's DistributedOptimizer)."""
    return bool(getattr(engine, "distributed_optimizer", False))


def _layout() -> dict[str, int]:
    return {
        "tensor": mpu.get_tensor_model_parallel_world_size(),
        "pipeline": mpu.get_pipeline_model_parallel_world_size(),
        "data": mpu.get_data_parallel_world_size(),
    }


def _rng_sharded_object(state: Any) -> ShardedObject:
    """This rank's RNG state as one cell of a (PP, TP, DP) grid: every rank stores its own."""
    layout = _layout()
    return ShardedObject(
        _RNG_KEY,
        state,
        (layout["pipeline"], layout["tensor"], layout["data"]),
        (
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_data_parallel_rank(),
        ),
        replica_id=0,
    )


def _sharded_state(engine, *, with_optimizer: bool, is_loading: bool, rng_state: Any) -> dict:
    """The dist_checkpointing state dict of an engine; ``rng_state=None`` leaves RNG out."""
    model = engine.model_sharded_state_dict()
    state = {"model": model}
    if with_optimizer:
        state["optimizer"] = engine.optimizer_sharded_state_dict(model, is_loading=is_loading)
    if rng_state is not None:
        state[_RNG_KEY] = _rng_sharded_object(rng_state)
    return state


def _check_weights_only_loadable(extra_state: dict) -> None:
    """Fail at save time, not at resume: dist_checkpointing reads the common state (common.pt up to megatron-core
    0.16, an item of a shard from 0.19) with torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(extra_state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as error:
        raise ValueError(
            "extra_state must hold only Python builtins and torch tensors (the checkpoint is read with "
            f"torch.load(weights_only=True)): {error}"
        ) from None


def _config_yaml(config: dict) -> str:
    try:
        return yaml.safe_dump(config, sort_keys=False)
    except yaml.YAMLError as error:
        raise ValueError(f"config must hold only plain YAML values (dicts, lists, str, numbers): {error}") from None


# ----------------------------------------------------------------------------- the manager
class CheckpointManager:
    """Saves training checkpoints under ``<run_dir>/checkpoints`` and finds the one to resume from.

    ``save``, ``load`` and ``find_resume`` are collective in a distributed job (every rank calls them; rank 0
    makes the file-system decisions); ``find_resume`` also works in a plain process. Keeps the ``keep_last``
    newest complete checkpoints.
    """

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(
                f"trainer.keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}"
            )
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last

    @property
    def checkpoints_dir(self) -> Path:
        """``<run_dir>/checkpoints``."""
        return self.run_dir / CHECKPOINTS_DIR

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Every ``step_N`` folder (complete or not) as (N, path), newest step first."""
        return step_dirs(self.run_dir)

    # ------------------------------------------------------------------------- save
    def save(self, engine, step: int, extra_state: dict | None = None, config: dict | None = None,
             companions: dict | None = None) -> Path:
        """Write a checkpoint of ``engine`` after trainer step ``step``; collective. Returns its folder.

        Stores the model, the optimizer (once it has taken a step), the learning-rate schedule, every rank's
        RNG states, ``extra_state`` (the same on every rank: rank 0's copy is kept; builtins and tensors only)
        and ``config`` (plain YAML values), and each of ``companions`` ({name: a second training engine}) in its
        subfolder (``grpo_mega.checkpoint.companions``). Then publishes it atomically and prunes to ``keep_last``.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        extra_state = dict(extra_state or {})
        _check_weights_only_loadable(extra_state)
        config_text = _config_yaml(dict(config or {}))
        # Captured before anything else runs, so saving cannot shift the streams a resumed run continues.
        rng_state = capture_rng_state()
        start = time.perf_counter()
        final = self.checkpoints_dir / step_dir_name(step)
        staging = self.checkpoints_dir / f"{TMP_PREFIX}{final.name}"
        rank0_decides(lambda: self._prepare_staging(staging))  # a broadcast: no rank writes before it is done
        with_optimizer = engine.steps_done > 0  # before the first step the optimizer has no state to save
        try:
            self._write(engine, staging, with_optimizer=with_optimizer, rng_state=rng_state, extra_state=extra_state)
            for name, companion in (companions or {}).items():
                save_companion(companion, staging / name)
            # Each rank checksums the files it wrote, still in its page cache, all ranks at once; rank 0 the rest.
            checksums = checksums_of(staging, written_by_this_rank(staging))
            if is_distributed():  # also the barrier: every rank's files are on disk before rank 0 lists them
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, checksums)
                checksums = {name: value for part in gathered for name, value in part.items()}
            info = self._info(engine, step, with_optimizer)
            pause_point("checkpoint.publish")  # tests: a Ctrl-C once every rank's files are written
            # Once begun, publishing finishes (a Ctrl-C now, on any rank, ends the run after it): a checkpoint is
            # published whole or, interrupted before this, its staging folder is discarded by the next save.
            with ctrl_c_deferred():
                pause_point("checkpoint.publishing")  # tests: a Ctrl-C while it publishes
                rank0_decides(lambda: self._publish(staging, final, info, config_text, checksums))
        except BaseException as error:  # torch's CheckpointException is a BaseException
            error.add_note(f"while saving the checkpoint of step {step} into {staging}")
            full = None if isinstance(error, (KeyboardInterrupt, SystemExit)) else full_disk_error(staging, step, error)
            if full is None:
                raise
            if is_rank0():  # the space back for the logs; the next save would remove it anyway
                shutil.rmtree(staging, ignore_errors=True)
            raise full from error
        if is_rank0():
            logger.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - start)
        return final

    @staticmethod
    def _write(engine, staging: Path, *, with_optimizer: bool, rng_state: Any, extra_state: dict) -> None:
        """This rank's files of the checkpoint: DeepSpeed's own, or megatron dist_checkpointing's."""
        if _engine_name(engine) == "deepspeed":
            engine.save_training_state(staging, rng_state=rng_state, scheduler=engine.schedule_state_dict(),
                                       extra_state=extra_state)
        else:
            state = _sharded_state(engine, with_optimizer=with_optimizer, is_loading=False, rng_state=rng_state)
            state["scheduler"] = engine.schedule_state_dict()
            state["extra_state"] = extra_state
            keep_write_results_in_process()  # a synchronous save: no manager process for the write results
            dist_checkpointing.save(state, str(staging))

    @staticmethod
    def _info(engine, step: int, with_optimizer: bool) -> dict:
        """What the checkpoint is (``grpo_mega_checkpoint.json``)."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": step,
            "optimizer_steps": engine.steps_done,
            "has_optimizer": with_optimizer,
            "engine": _engine_name(engine),
            "layout": _layout(),
            "cuda_rng": torch.cuda.is_available(),
            "param_dtype": str(engine.param_dtype).removeprefix("torch."),
            "distributed_optimizer": _distributed_optimizer(engine),
            "lr_schedule_unit": "trainer_steps",
            # LoRA: the model holds the adapters alone; "base" names the frozen weights they go with
            **({"lora": engine.lora.describe()} if getattr(engine, "lora", None) is not None else {}),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _prepare_staging(self, staging: Path) -> None:
        """Rank 0: an empty staging folder; leftovers of crashed saves or deletions go first."""
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.checkpoints_dir.glob(f"{TMP_PREFIX}*"):
            logger.warning("removing %s, left by an interrupted save or deletion", leftover)
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        staging.mkdir()

    def _publish(self, staging: Path, final: Path, info: dict, config_text: str,
                 checksums: dict[str, str] | None = None) -> None:
        """Rank 0: side files, completion marker (last, with every file's size and checksum: those the ranks
        computed of their own files, ``checksums``, rank 0's of the rest), rename, ``latest``, pruning."""
        checksums = checksums or {}
        (staging / STATE_FILE).write_text(json.dumps(info, indent=2) + "\n")
        (staging / CONFIG_FILE).write_text(config_text)
        files = list_files(staging)
        complete = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": info["step"], "files": files,
                    "checksum_algorithm": CHECKSUM_ALGORITHM,
                    "checksums": {name: checksums.get(name) or file_checksum(staging / name) for name in files}}
        write_file_atomic(staging / COMPLETE_FILE, json.dumps(complete, indent=2) + "\n")
        if final.exists():
            # Saving a step again (a run resumed from an earlier checkpoint): set the old folder aside first.
            replaced = self.checkpoints_dir / f"{TMP_PREFIX}replaced-{final.name}"
            os.rename(final, replaced)
            os.rename(staging, final)
            shutil.rmtree(replaced)
        else:
            os.rename(staging, final)
        fsync_dir(self.checkpoints_dir)
        write_file_atomic(self.checkpoints_dir / LATEST_FILE, final.name + "\n")
        self._prune(info["step"])

    def _prune(self, newest_step: int) -> None:
        """Rank 0: delete complete checkpoints older than the ``keep_last`` newest; the one just saved stays.

        Incomplete folders are left alone (they are reported when resuming), and so are folders of later
        steps, which come from before the run was resumed from an earlier checkpoint.
        """
        older_complete, newer = [], []
        for step, path in self.step_dirs():
            if step > newest_step:
                newer.append(path)
            elif step < newest_step and checkpoint_problem(path) is None:
                older_complete.append(path)
        for path in older_complete[self.keep_last - 1:]:
            # Renamed first, so a crash mid-deletion leaves a staging leftover, not a truncated step folder.
            doomed = self.checkpoints_dir / f"{TMP_PREFIX}deleting-{path.name}"
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        if newer:
            logger.warning(
                "checkpoints %s are newer than the one just saved (step %d), from before this run went back; "
                "left in place (resume: auto follows %s)", [p.name for p in newer], newest_step, LATEST_FILE,
            )

    # ------------------------------------------------------------------------- resume
    def find_resume(self, resume: str, *, verify: bool = True) -> Path | None:
        """The checkpoint to resume from, per ``trainer.resume``; collective.

        ``none``: None. ``auto``: the checkpoint ``latest`` names if it is complete and its files match their
        checksums, else the newest ``step_N`` folder that is and does (each skipped folder is logged as a warning
        with the reason; resuming from an older one than the newest says so), else None; ValueError when every
        complete checkpoint was altered (starting over would hide it). Anything else is a checkpoint folder, which
        must be complete and match its checksums (ValueError with the reason otherwise). ``verify=False``: sizes
        only (the run's own end, naming its newest checkpoint).
        """
        if not isinstance(resume, str) or not resume:
            raise ValueError(f"trainer.resume must be 'auto', 'none' or a checkpoint folder, got {resume!r}")
        if resume == "none":
            return None
        if resume == "auto":
            return newest_verified(self.run_dir, verify=verify)

        def check_explicit() -> Path:
            problem = checkpoint_problem(resume)
            if problem is not None:
                raise ValueError(f"trainer.resume={resume!r} is not a complete training checkpoint: {problem}")
            return Path(resume)

        path = rank0_decides(check_explicit)
        problem = content_problem(path) if verify else None
        if problem is not None:
            raise ValueError(f"trainer.resume={resume!r} is refused: {problem}")
        return path

    def newest_complete(self, skip: Collection[Path] = ()) -> Path | None:
        """The checkpoint ``latest`` names if complete, else the newest complete ``step_N``, passing over ``skip``;
        in this process only, sizes only (``find_resume`` is the collective one, which checks the checksums too).
        Each skipped incomplete folder is logged with the reason."""
        return newest_complete(self.run_dir, warn=logger.warning, skip=skip)

    def load(self, engine, path: str | os.PathLike, *, seed: int, companions: dict | None = None) -> LoadedCheckpoint:
        """Restore ``engine`` from the checkpoint at ``path`` (at this job's TP / PP / DP), and each of
        ``companions`` from its subfolder; collective.

        Model and optimizer are restored at any layout (megatron reshards). The learning-rate schedule resumes
        at its saved position with the settings of the current config (the engine's): rank 0 logs which changed.
        RNG states are restored rank for rank when the layout (and having CUDA or not) equals the saved one;
        otherwise every generator is reseeded with ``seed + step`` (``grpo_mega.parallel.seed_everything``) and a
        warning says so. Raises ValueError when ``path`` is not a complete checkpoint.
        """
        from grpo_mega.parallel import seed_everything

        path = Path(path)
        info = rank0_decides(lambda: read_checkpoint_state(path))
        # A CPU-only process cannot take a CUDA generator state (or the other way round): reseed then too.
        saved_cuda = info.get("cuda_rng", False)  # absent in the first checkpoints of this format: CPU runs
        same_layout = info["layout"] == _layout() and saved_cuda == torch.cuda.is_available()
        saved_engine = info.get("engine", "megatron")
        if saved_engine != _engine_name(engine):
            raise ValueError(f"{path} was saved by the {saved_engine} engine and cannot be resumed by the "
                             f"{_engine_name(engine)} engine; start a new run from its weights (model.init_from={path})")
        if saved_engine == "deepspeed":
            loaded = engine.load_training_state(path, with_optimizer=info["has_optimizer"], with_rng=same_layout)
            changed = loaded["optimizer_changes"]
        else:
            # A template of the right structure; dist_checkpointing replaces it with the saved object.
            rng_template = capture_rng_state() if same_layout else None
            # Saved with the distributed optimizer and resumed without it, or the other way round: the optimizer
            # state is mapped across (grpo_mega.checkpoint.optimizer_state); absent in older checkpoints: without.
            saved_distributed = info.get("distributed_optimizer", False)
            across = info["has_optimizer"] and saved_distributed != _distributed_optimizer(engine)
            state = _sharded_state(engine, with_optimizer=info["has_optimizer"] and not across, is_loading=True,
                                   rng_state=rng_template)
            loaded = load_sharded(state, path)  # TE / local layer specs either way
            engine.load_model_state_dict(loaded["model"])
            changed = []
            if across:
                changed = engine.load_optimizer_state_dict(
                    load_across_modes(engine, path, saved_distributed=saved_distributed))
                if is_rank0():
                    logger.info("%s saved with %s=%s, resumed with %s: optimizer state mapped across", path,
                                SETTING, str(saved_distributed).lower(), str(not saved_distributed).lower())
            elif info["has_optimizer"]:
                changed = engine.load_optimizer_state_dict(loaded["optimizer"])
            else:
                engine.reload_after_weight_load()  # fp32 master copies (bf16) follow the loaded weights
        if changed and is_rank0():
            logger.info("optimizer settings follow the config (%s)", ", ".join(changed))
        engine.steps_done = info["optimizer_steps"]
        _restore_schedule(engine, loaded["scheduler"], info)
        for name, companion in (companions or {}).items():
            load_companion(companion, path / name, name)
        step = info["step"]
        if same_layout:
            restore_rng_state(loaded[_RNG_KEY] if saved_engine == "megatron" else loaded["rng_state"])
        else:
            seed_everything(seed + step)
            if is_rank0():
                logger.warning(
                    "checkpoint %s was saved at layout %s (CUDA: %s), this job runs %s (CUDA: %s): per-rank RNG "
                    "states cannot be restored, reseeded with seed %d + step %d",
                    path, info["layout"], saved_cuda, _layout(), torch.cuda.is_available(), seed, step,
                )
        config = yaml.safe_load((path / CONFIG_FILE).read_text()) or {}
        return LoadedCheckpoint(step=step, extra_state=loaded["extra_state"], config=config)


def _restore_schedule(engine, saved: dict, info: dict) -> None:
    """Resume the learning-rate schedule at its saved position, with the engine's (the config's) settings.

    Checkpoints written before the schedule counted trainer steps (no ``lr_schedule_unit``) hold a position in
    optimizer steps: the trainer step they were saved after is the position in trainer steps.
    """
    legacy = info.get("lr_schedule_unit") != "trainer_steps"
    position = info["step"] if legacy else int(saved["num_steps"])
    changes = engine.restore_schedule(saved, position=position)
    if is_rank0():
        logger.info(
            "learning-rate schedule follows the config (%s); resuming at schedule step %d, lr %.6g%s",
            ", ".join(changes) or "unchanged", position, engine.current_lr,
            f" (the checkpoint counted {saved['num_steps']} optimizer steps)" if legacy else "",
        )
