"""The life cycle every training run shares (GRPO, SFT, PRM training), in torchtitan's shape: one object owns the
distributed set-up, the checkpoints and resume, stop requests, the metrics log, scheduled saves and the final
shutdown, so that each trainer writes only its own step::

    harness = RunHarness(cfg)                  # stop signals caught, then distributed state (torchrun / SLURM)
    ...                                        # the trainer's data and engine
    harness.start(engine, state=...)           # resume, or the trainer's initial weights; config.yaml; metrics log
    for step in harness.steps():
        metrics = ...                          # the trainer's step
        harness.end_step(step, metrics)        # agree on a stop, log, save on schedule or when stopping
    harness.finish()                           # close, shut down; StoppedEarly after a stop

Failing: whatever ends a rank is recorded by the command in ``run_dir/failure.json`` (``grpo_mega.run.failure``),
with the step and phase the harness and the trainer mark; every collective is bounded by
``trainer.collective_timeout_s``, so a hung or dead peer ends the job too, and so is every bounded phase (the save,
the weight sync, PRM scoring, the vLLM wake / sleep: ``grpo_mega.run.watchdog``), so a rank hung on its own does.

Stopping early: a signal (SIGTERM, SIGUSR1, SIGUSR2) on any rank, or ``trainer.save_before_seconds`` left before
the time limit, makes every rank save the step in flight; :meth:`RunHarness.finish` then raises ``StoppedEarly``,
which the commands turn into exit status 3 (``grpo_mega.run.control``). A second stop signal, or
``trainer.stop_grace_s`` passing before the step in flight ends, ends the process at once instead, from the last
checkpoint (exit status 128 + the signal). The same command resumes exactly: the
checkpoint holds the engine (model, optimizer, schedule, RNG states) and the trainer's state (what each trainer's
holds: ``grpo_mega.harness.resume``), and each trainer's batches depend only on the seed and the step, or on that
state.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from grpo_mega.checkpoint.training import CheckpointManager
from grpo_mega.config import save_config
from grpo_mega.harness.resume import TrainerState, restore
from grpo_mega.harness.resume import save as save_checkpoint
from grpo_mega.parallel import destroy_distributed, get_device, init_distributed
from grpo_mega.perf.startup import StartupClock
from grpo_mega.run.checkpoints import newest_complete
from grpo_mega.run.config_history import record_config
from grpo_mega.run.control import StoppedEarly, StopRequests, exit_status_stopped_now, run_end_time
from grpo_mega.run.failure import POSITION, phase, set_aside_failure, set_step
from grpo_mega.run.folder import check_run_folder
from grpo_mega.run.interrupts import pause_point
from grpo_mega.run.layout import CONFIG_FILE, STEP_DIR
from grpo_mega.run.metrics import MetricsLogger, logger_options
from grpo_mega.run.progress import SkippedRows, collect_skipped_rows
from grpo_mega.run.watchdog import PhaseWatchdog

def on_schedule(step: int, every: int, total_steps: int) -> bool:
    """Whether ``step`` is a multiple of ``every`` (0: never) or the last of ``total_steps``: when to save, evaluate
    (also the rollout world's evaluations in ``rollout.mode: async``)."""
    return bool(every and step % every == 0) or step == total_steps


class RunHarness:
    """One training run of ``cfg`` (a GRPO, SFT or PRM config: its ``parallel`` and ``trainer`` sections).

    Creating it catches the stop signals (first, so a signal during the set-up is not lost) and sets up the
    distributed state; :meth:`start`, :meth:`steps`, :meth:`end_step` and :meth:`finish` are collective (every
    rank calls them, in the same order).
    """

    def __init__(self, cfg: Any, *, command: str = "grpo-mega"):
        self.cfg = cfg
        self.command = command
        self.skipped_rows = SkippedRows()
        """The bad rows this run's reads skipped (its files load after this), for its ``done`` line; in async mode
        the trainer adds the rollout world's (``RolloutFeed.skipped_rows``)."""
        collect_skipped_rows(self.skipped_rows)
        run = cfg.trainer
        self._resume_point: Path | None = None  # the newest complete checkpoint of this run: where a resume starts
        self.startup = StartupClock()
        """Start-up seconds by phase; trainers mark theirs (``startup.mark``), logged in the first step's row."""
        self.startup.mark("imports")
        self.stop_requests = StopRequests(save_before_seconds=run.save_before_seconds,
                                          end_time=run_end_time(run.time_limit_seconds),
                                          stop_now=self._stop_now, grace_s=run.stop_grace_s).install()
        init_distributed(cfg.parallel.tensor, cfg.parallel.pipeline, seed=cfg.parallel.seed, device=cfg.parallel.device,
                         timeout_s=run.collective_timeout_s, ep=cfg.parallel.expert)
        self.startup.mark("distributed")
        self.run_dir = Path(run.run_dir)
        self.watchdog = PhaseWatchdog(self.run_dir, run.collective_timeout_s, command=command,
                                      setting=f"trainer.collective_timeout_s={run.collective_timeout_s:g} s").install()
        self.is_rank0 = dist.get_rank() == 0
        self.total_steps = run.total_steps
        self.checkpoints = CheckpointManager(self.run_dir, keep_last=run.keep_last)
        # the step the run continues after (a resumed checkpoint's), and the last step ended
        self.start_step = self.step = 0
        self.stop_reason: str | None = None
        self.last_checkpoint: Path | None = None
        self.metrics_log: MetricsLogger | None = None
        self._engine = None
        self._companions: dict = {}
        self._state: TrainerState | None = None
        self._startup_metrics: dict[str, float] = {}

    def start(self, engine, *, state: TrainerState, initial_weights: Callable[[], Any] | None = None,
              shown: Mapping[str, str] | None = None, companions: Mapping[str, Any] | None = None) -> int:
        """Resume ``engine``, its ``companions`` ({name: a second training engine saved with it, e.g. the implicit
        PRM}) and the trainer's ``state`` (``grpo_mega.harness.resume``: what each trainer's checkpoint
        holds) from the checkpoint ``trainer.resume`` names, or, with none, call ``initial_weights``; write
        ``run_dir/config.yaml`` and the config history (``grpo_mega.run.config_history``), and open the metrics log
        (its progress bar or step lines, and the summary line at the end, show the ``shown`` figures: label -> metric
        name). Returns the step to continue after (0 for a new run)."""
        self._engine = engine
        self._companions = dict(companions or {})
        self._state = state
        if self.is_rank0:  # the command checked it before any rank started; a run started otherwise is checked here
            check_run_folder(asdict(self.cfg))
        resumed = restore(self.checkpoints, engine, self._state, resume=self.cfg.trainer.resume,
                          seed=self.cfg.parallel.seed, companions=self._companions)
        if resumed is not None:
            self.start_step = self.step = resumed.step
            self._resume_point = resumed.checkpoint
        elif initial_weights is not None:
            initial_weights()
        self.startup.mark("load")
        if self.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / CONFIG_FILE)
            # the config history (run_dir/configs/) and, on a resume with changes, the block that lists them
            if resumed is None:
                record_config(self.run_dir, asdict(self.cfg))
            else:
                record_config(self.run_dir, asdict(self.cfg), step=resumed.step, previous=resumed.config,
                              checkpoint=resumed.checkpoint)
            set_aside_failure(self.run_dir)  # an earlier attempt's; kept beside, so this one can name its own cause
        self.metrics_log = MetricsLogger(
            self.run_dir, total_steps=self.total_steps, start_step=self.start_step, active=self.is_rank0,
            progress_bar=self.cfg.trainer.progress_bar, shown=shown, **logger_options(self.cfg),
        )
        return self.start_step

    def steps(self) -> Iterator[int]:
        """The steps to run, ``start_step + 1`` through ``trainer.total_steps``; ends after a step that stopped."""
        for step in range(self.start_step + 1, self.total_steps + 1):
            self._startup_metrics = self.startup.finish()  # the first step's; empty afterwards
            set_step(step)
            POSITION["phase"] = "step"  # the trainer marks its phases inside (generation, update, sync, ...)
            pause_point(f"step.{step}")  # tests: a step that takes long (a stop signal while it is in flight)
            yield step
            if self.stop_reason:
                return

    def on_schedule(self, step: int, every: int) -> bool:
        """Whether ``step`` is a multiple of ``every`` (0: never) or the last step: when to save, evaluate."""
        return on_schedule(step, every, self.total_steps)

    def end_step(self, step: int, metrics: dict[str, float]) -> None:
        """After the trainer's step: every rank agrees whether to stop now (a signal on any rank, the time limit;
        never after the last step), the step's metrics are logged, and a checkpoint is saved on schedule
        (``trainer.save_every``, the last step) or when stopping.

        The step is logged before its checkpoint is saved: a job killed in between repeats the step on resume and
        the log keeps its newer record (one row per step), instead of losing the step's row.
        """
        self.step = step
        with phase("end of step (stop agreement, metrics)"):
            self.stop_reason = None if step == self.total_steps else self.stop_requests.agreed_reason(get_device())
            self.metrics_log.log(step, {**metrics, **self._startup_metrics})
            self._startup_metrics = {}
        if self.stop_reason:
            self.stop_requests.step_ended()  # the step in flight ended: trainer.stop_grace_s no longer runs
        if self.on_schedule(step, self.cfg.trainer.save_every) or self.stop_reason:
            self.save(step)

    def save(self, step: int) -> Path:
        """A checkpoint of the engine and the trainer's state after ``step``, with the run config."""
        with phase("save", bounded=True):
            self.last_checkpoint = save_checkpoint(self.checkpoints, self._engine, self._state, step,
                                                   config=asdict(self.cfg), companions=self._companions)
        self._resume_point = self.last_checkpoint
        return self.last_checkpoint

    def _stop_now(self, reason: str, signum: int) -> None:
        """End this process at once (``grpo_mega.run.control``: a second stop signal, or ``trainer.stop_grace_s``
        over): one line saying so and where the run resumes, exit status 128 + ``signum``. No clean-up that could
        wait: no save, no collective; the rank's helper processes end with it (``grpo_mega.run.reaper``), and a
        save it was writing stays an unpublished ``.tmp-*`` folder that no resume loads."""
        point, resume = self._resume_point, str(self.cfg.trainer.resume)
        if point is None and resume != "none":  # still starting: where this start would have resumed from
            point = newest_complete(self.run_dir) if resume == "auto" else Path(resume)
        match = STEP_DIR.match(point.name) if point is not None else None
        where = (f"its last checkpoint, {point} (step {int(match.group(1))})" if match
                 else "its start (no checkpoint yet)")
        step = POSITION.get("step")
        saved = match is not None and step is not None and int(match.group(1)) >= step
        what = "during start-up" if step is None else f"after saving step {step}" if saved else \
            f"without saving step {step}"
        line = f"{self.command}: {reason}: stopped at once {what}; the same command resumes from {where}\n"
        sys.stderr.flush()
        try:  # one write, newline included: the lines of ranks sharing a stderr never interleave
            os.write(sys.stderr.fileno(), line.encode())
        except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
            print(line, end="", file=sys.stderr, flush=True)
        os._exit(exit_status_stopped_now(signum))

    def fail_step(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of a step that failed (e.g. a NaN loss, as it was) and close the log; the trainer
        then raises its error."""
        self.metrics_log.log(step, metrics)
        self.metrics_log.close()

    def finish(self, *, before_shutdown: Callable[[], None] | None = None) -> Path | None:
        """Close the metrics log, restore the signal handlers, call ``before_shutdown`` (e.g. closing a rollout
        engine that holds process groups) and tear down the distributed state. Raises ``StoppedEarly`` when the run
        stopped early; else returns the newest checkpoint (the last step's). Before either, rank 0 prints the run's
        summary line (``grpo_mega.run.progress``)."""
        self.metrics_log.close()
        self.stop_requests.uninstall()
        self.watchdog.close()
        if before_shutdown is not None:
            before_shutdown()
        destroy_distributed()
        collect_skipped_rows(None)  # later reads of this process belong to no run
        newest = self.last_checkpoint if self.last_checkpoint is not None else self.checkpoints.find_resume("auto", verify=False)
        if self.metrics_log.progress is not None:
            command_start = self.startup.start - self.startup.seconds.get("launch", 0.0)
            print(self.metrics_log.progress.summary(self.command, wall_seconds=time.time() - command_start,
                                                    checkpoint=newest, stop_reason=self.stop_reason,
                                                    skipped_rows=self.skipped_rows), flush=True)
        if self.stop_reason:
            raise StoppedEarly(self.step, self.stop_reason)
        return newest
