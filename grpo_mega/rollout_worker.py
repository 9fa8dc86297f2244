"""The rollout world of ``rollout.mode: async``: generation, rewards and PRM scoring on their own ranks.

Its loop, top to bottom (``run_rollout_worker``; the schedule is ``grpo_mega.stages.rollout_feed``'s):

1. the trainer says where to begin (``start``: the first step to generate, the prompt sampler's state when a
   checkpoint resumes) and sends the weights it starts from;
2. for each step ``n``: take weights versions from the bridge until this world holds version ``n - 1 - k``
   (``k = rollout.max_staleness``), evaluating the versions the evaluation schedule names as they arrive; then the
   rollout stage of colocated mode (prompts -> G completions -> outcome rewards -> PRM step rewards -> dynamic
   sampling) and the batch to the trainer, with its metrics and the version that made it;
3. after the last step: the remaining versions (the last one's evaluation), then ``stop`` -> ``bye``; a ``stop``
   before it (the trainer stopped the run early: a signal, the time limit) -> ``bye``, and exit status 3 as the
   trainer's (``grpo_mega.run.control.StoppedWithTheRun``).

Rewards and PRM scoring run here, off the training ranks' critical path: the PRM is a forward-only model like the
rollout engine, the scores it gives belong to the batch they are sent with, and the trainer's devices keep only
the policy (and reference). Every rollout rank runs this loop (SPMD within the rollout world: generation and
scoring are split over its ranks and gathered); rank 0 talks to the bridge and relays to the others.

Stop signals are recorded and not acted on: the training ranks decide when the job stops (they save, and the
checkpoint needs the batches in flight from this world), then send ``stop``. Unless the trainer is gone: a stop
signal is also how a launcher tears this rank down after the trainer's node died (srun ends the step, torchrun's
agent lost the job's store with that node), and then nobody would decide. So on each stop signal rank 0 probes
the bridge (``grpo_mega.rollout.link.RolloutLink.check_trainer``: a send fails at once on a closed connection) and,
the trainer gone, raises ``TrainerLost`` where it stands (in generation, say), which the command names ``peer_lost`` in
failure.json; a rank that found the bridge closed itself waits only 0.5 s after the signal for another rank to name
the failure (``grpo_mega.run.failure.DEFER_AFTER_SIGNAL_S``). Measured before: under SLURM, 3 of 20 faults that
SIGKILLed the trainer left no failure.json (the rollout rank got the launcher's SIGTERM during its 3 s wait and was
killed before the end of it); after, 5 of 5 named (``bench/chaos.py --variant async --launcher slurm --steps 24
--kinds store_lost,save_kill``, ``--seed 0 --faults 2`` and ``--seed 1 --faults 3``; before, seed 0 named 1 of 2).
"""

from __future__ import annotations

import functools
import logging
import time

from grpo_mega.config import GRPOConfig
from grpo_mega.data.prompts import PromptBatches
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.harness.lifecycle import on_schedule
from grpo_mega.parallel import destroy_distributed, init_distributed
from grpo_mega.parallel.roles import RoleSplit
from grpo_mega.rollout.base import decode_response
from grpo_mega.rollout.bridge import Bridge
from grpo_mega.rollout.link import RolloutLink, TrainerStopped
from grpo_mega.run.control import StoppedWithTheRun, StopRequests
from grpo_mega.run.failure import phase, set_step
from grpo_mega.run.progress import SkippedRows, collect_skipped_rows
from grpo_mega.run.watchdog import PhaseWatchdog
from grpo_mega.stages import RolloutStage
from grpo_mega.stages.answer_guard import answer_guard_of
from grpo_mega.stages.turn_steps import turn_steps_of
from grpo_mega.stages.rollout import sampling_from_config
from grpo_mega.stages.rollout_feed import generating_version
from grpo_mega.stages.rollout_setup import (build_rollout_engine_for, close_rollout_engine, eval_prompts,
                                            load_prompts, row_layout_of, run_evaluation, step_reward_source)

logger = logging.getLogger(__name__)


def run_rollout_worker(cfg: GRPOConfig, split: RoleSplit) -> dict[str, float]:
    """Serve the training world until it says stop (module docstring). Returns {} (the trainer reports)."""
    alg, run = cfg.algorithm, cfg.trainer
    stop_requests = StopRequests().install()  # passed on with every batch: the trainer decides
    init_distributed(1, 1, seed=cfg.parallel.seed, device=cfg.parallel.device, timeout_s=run.collective_timeout_s)
    watchdog = PhaseWatchdog(run.run_dir, run.collective_timeout_s, command="grpo-mega train (rollout world)",
                             setting=f"trainer.collective_timeout_s={run.collective_timeout_s:g} s").install()
    skipped_rows = SkippedRows()  # this world's reads, sent with every batch for the trainer's `done` line
    collect_skipped_rows(skipped_rows)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_config)
    prompts = PromptBatches(load_prompts(cfg, tokenizer, cfg.data.train_file), alg.rollout_batch_size,
                            seed=cfg.parallel.seed)
    eval_records = eval_prompts(cfg, tokenizer)
    engine = build_rollout_engine_for(cfg, tokenizer)
    decode = functools.partial(decode_response, tokenizer)
    stage = RolloutStage(engine, prompts, sampling_from_config(cfg), cfg.reward, alg, seed=cfg.parallel.seed,
                         decode=decode, step_reward_source=step_reward_source(cfg, decode),
                         answer_guard=answer_guard_of(cfg), step_pattern=cfg.process_reward.step_pattern,
                         row_layout=row_layout_of(cfg), turn_steps=turn_steps_of(cfg))
    link = RolloutLink(Bridge(split.bridge_group(), is_trainer=False) if split.layout.on_bridge else None, engine)
    link.check_trainer_on_stop_signals()  # stop_requests.uninstall() puts the handlers from before both back
    k, total = cfg.rollout.max_staleness, run.total_steps

    kind, start = link.receive()
    if kind != "start":
        raise RuntimeError(f"the trainer sent {kind!r} before 'start'")
    if start["prompts"] is not None:
        prompts.load_state_dict(start["prompts"])
    fresh = start["version"] == 0 and start["first_step"] == 1

    def take_weights() -> float:
        """The next version, evaluated when the schedule names it; returns the seconds waited and loaded."""
        began = time.perf_counter()
        with phase("waiting for weights"):
            version = link.take_weights()
        if eval_records and ((version == 0 and fresh) or (version > start["version"] and
                                                          on_schedule(version, run.eval_every, total))):
            with phase("evaluation"):
                link.send("eval", {"version": version,
                                   "metrics": run_evaluation(cfg, engine, eval_records, version)}, key=version)
        return time.perf_counter() - began

    stopped_at = None
    try:
        take_weights()
        for step in range(start["first_step"], total + 1):
            set_step(step)
            waited = link.receive_seconds
            weights_wait = 0.0
            while link.version < generating_version(step, k):
                weights_wait += take_weights()
            began = time.perf_counter()
            with phase("generation"):
                batch, metrics = stage.run(step)
            seconds = time.perf_counter() - began
            tokens = sum(len(c.response_ids) for c in batch.completions)
            metrics.update({"async/weights_version": float(link.version), "async/generation_s": seconds,
                            "async/rollout_wait_s": weights_wait,
                            "async/weights_receive_s": link.receive_seconds - waited,
                            "async/generation_tokens_per_s": tokens / seconds if seconds > 0 else 0.0})
            with phase("sending the batch"):
                link.send("batch", {"step": step, "batch": batch, "metrics": metrics,
                                    "prompts": prompts.state_dict(), "stop_signal": stop_requests.signal_name,
                                    "skipped_rows": skipped_rows.reads}, key=step)
                link.settle(generating_version(step, k))  # the trainer has taken the batches of those steps
        while link.version < total:
            take_weights()
        kind, _ = link.receive()
        if kind != "stop":
            raise RuntimeError(f"the trainer sent {kind!r} after the last weights version, where 'stop' was due")
    except TrainerStopped:
        logger.info("rollout world: the trainer stopped the run at version %d", link.version)
        stopped_at = link.version
    link.send("bye")
    link.settle()
    watchdog.close()
    stop_requests.uninstall()
    close_rollout_engine(engine)
    destroy_distributed()
    collect_skipped_rows(None)
    if stopped_at is not None and stopped_at < total:  # exit as the trainer does (3), not 0: StoppedWithTheRun
        raise StoppedWithTheRun(stopped_at, "the trainer stopped the run")
    return {}
