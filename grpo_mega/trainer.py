"""GRPO with outcome or process supervision: ``grpo-mega train --config FILE [key=value ...]``.

One step, top to bottom (``train``): the rollout stage (prompts -> G completions each -> rewards per completion and
per step -> dynamic-sampling filter) -> with ``process_reward.source: implicit``, the implicit PRM's update on the
batch's outcomes and its step rewards (``grpo_mega.stages.implicit_prm``; with
``implicit_prm.before_dynamic_sampling`` inside the rollout stage, before the filter) -> the batch builder (advantages on
``prompt + response`` rows) -> the update runner (old / reference log-probs, ppo_epochs x mini-batch updates) -> the
learning-rate schedule advances one step -> weight sync to the rollout engine, on every step (vLLM discards its
weights when it sleeps) -> metrics (``memory/generation/*`` and ``memory/update/*``: ``grpo_mega.perf.memory``) ->
checkpoint / evaluation on schedule. With ``parallel.offload_during_rollout`` the policy's gradient buffers and
optimizer state stay in host memory from the end of one update to the start of the next (sync, generation, rewards),
and the implicit PRM's until its update.
Every rank runs this loop on the same data (SPMD); the engine shards rows over data-parallel ranks itself. The
run's life cycle around the step (distributed set-up, resume, metrics log, saves, stop requests, shutdown) is
``grpo_mega.harness.lifecycle``'s, shared with SFT and PRM training.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_mega.checkpoint.initial_weights import load_initial_weights
from grpo_mega.checkpoint.rng import rng_state_kept
from grpo_mega.checkpoint.source import resolve_model_source
from grpo_mega.config import GRPOConfig
from grpo_mega.config.checks import check_lora_imports
from grpo_mega.data.prompts import PromptBatches
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.engine import build_policy_engine, build_reference_engine
from grpo_mega.engine.base import NonFiniteError
from grpo_mega.harness.lifecycle import RunHarness
from grpo_mega.harness.resume import OneTimeFigures, grpo_state
from grpo_mega.lora import AdaptersOffReference, lora_attacher
from grpo_mega.model.config_map import load_model_hf_config
from grpo_mega.parallel import get_device
from grpo_mega.parallel.roles import ROLLOUT, split_roles
from grpo_mega.perf.memory import PhaseMemory
from grpo_mega.perf.parameters import parameter_figures
from grpo_mega.rollout import SyncStats, sync_weights
from grpo_mega.rollout.base import decode_response
from grpo_mega.run.failure import phase as failure_phase
from grpo_mega.run.layout import ROLLOUTS_DIR, step_dir_name
from grpo_mega.stages import RolloutBatch, RolloutStage, UpdateRunner, build_training_batch, group_advantages
from grpo_mega.stages.answer_guard import answer_guard_of
from grpo_mega.stages.implicit_prm import build_implicit_prm, implicit_prm_source
from grpo_mega.stages.rollout import sampling_from_config
from grpo_mega.stages.rollout_feed import RolloutFeed
from grpo_mega.stages.rollout_setup import (build_rollout_engine_for, close_rollout_engine, eval_prompts,
                                            load_prompts, row_layout_of, run_evaluation, settle_rollout_engine,
                                            step_reward_source)
from grpo_mega.stages.turn_credit_metrics import turn_credit_metrics
from grpo_mega.stages.turn_steps import turn_steps_of

logger = logging.getLogger(__name__)

GRPO_SHOWN = {"score": "critic/score/mean", "reward": "critic/rewards/mean", "accuracy": "eval/accuracy"}
"""The figures of the progress bar, the step lines and the summary: the trained batch's mean verifier score and
mean reward, and the held-out accuracy on evaluation steps."""


class Timer:
    """Wall-clock seconds per phase of a step, reported as ``timing_s/<phase>``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{phase}"] = self.seconds.get(f"timing_s/{phase}", 0.0) + time.perf_counter() - start


def train(cfg: GRPOConfig) -> dict[str, float]:
    """Run GRPO; returns the last evaluation metrics. Raises ``StoppedEarly`` after saving the step in flight when
    a stop signal arrived (on any rank) or the time limit came near (``grpo_mega.harness.lifecycle``).

    ``rollout.mode: async``: the job's last ``rollout.async_ranks`` processes become the rollout world
    (``grpo_mega.rollout_worker``) and the others train here; batches come from the rollout world
    (``grpo_mega.stages.rollout_feed``) instead of the rollout stage, and weights go to it instead of the engine."""
    alg = cfg.algorithm
    check_lora_imports(cfg)  # peft, for LoRA on DeepSpeed: named before anything is built
    settle_rollout_engine(cfg)  # rollout.engine: auto -> the faster engine on this device, for both roles
    split = None
    if cfg.rollout.mode == "async":
        split = split_roles(cfg.rollout.async_ranks, timeout_s=cfg.trainer.collective_timeout_s)
        if split.layout.role == ROLLOUT:
            from grpo_mega.rollout_worker import run_rollout_worker

            return run_rollout_worker(cfg, split)
    harness = RunHarness(cfg, command="grpo-mega train")
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_config)
    decode = functools.partial(decode_response, tokenizer)  # response token ids -> the completion's text
    # async: the rollout world samples the prompts (and a checkpoint keeps its sampler state)
    train_prompts = None if split else PromptBatches(load_prompts(cfg, tokenizer, cfg.data.train_file),
                                                     alg.rollout_batch_size, seed=cfg.parallel.seed)
    eval_records = eval_prompts(cfg, tokenizer)
    harness.startup.mark("data")

    # vLLM sizes its memory from what is free when it starts: build it before the training engines allocate.
    rollout_engine = build_rollout_engine_for(cfg, tokenizer) if cfg.rollout.engine == "vllm" and not split else None
    policy, reference = _build_engines(cfg)
    # process_reward.source: implicit: PRIME's implicit PRM, a second trained engine (saved with each checkpoint)
    implicit_prm = None if cfg.process_reward.source != "implicit" else build_implicit_prm(
        cfg, load_model_hf_config(cfg.model), kl_reference=reference, pad_id=tokenizer.pad_token_id,
        decode=decode)
    if implicit_prm is not None:
        implicit_prm.load_reference(implicit_prm_source(cfg))  # before a resume loads the PRM's trained weights
    harness.startup.mark("model_build")
    feed = None if split is None else RolloutFeed(split, max_staleness=cfg.rollout.max_staleness,
                                                  total_steps=cfg.trainer.total_steps,
                                                  bucket_bytes=cfg.rollout.sync_bucket_mb * 2**20)
    # model.init_from, resolved once: the reference always starts from it, the policy only when no checkpoint resumes
    source = resolve_model_source(cfg.model.init_from) if cfg.model.init_from else None
    if cfg.model.lora.enabled:  # the frozen base, under a resumed run's adapters too (checkpoints hold only those)
        load_initial_weights(policy, source)
    figures = OneTimeFigures()
    start_step = harness.start(policy, state=grpo_state(train_prompts, feed, figures),
                               initial_weights=lambda: _load_initial_weights(policy, source, implicit_prm, cfg),
                               shown=GRPO_SHOWN, companions=implicit_prm.companions() if implicit_prm else None)
    # Set-up after a resume restored the generators (engines built with a random initialisation) must not draw
    # from them, or a resumed run's streams would differ from an uninterrupted one's (bench/chaos.py).
    with rng_state_kept():
        if reference is not None and not cfg.model.lora.enabled:  # with LoRA the reference is the policy's base
            load_initial_weights(reference, source)
        offload = cfg.parallel.offload_during_rollout
        if feed is not None:  # the rollout world starts from this version of the weights
            feed.start(start_step, policy.export_hf_weights())
        else:
            if rollout_engine is None:
                rollout_engine = build_rollout_engine_for(cfg, tokenizer)
            _sync(policy, rollout_engine, cfg, offload=offload, implicit_prm=implicit_prm)
        harness.startup.mark("rollout_engine")  # built (vLLM before the model: its seconds count here too), synced
        memory = PhaseMemory(get_device())
        rollout = None if feed is not None else RolloutStage(
            rollout_engine, train_prompts, sampling_from_config(cfg), cfg.reward, alg, seed=cfg.parallel.seed,
            decode=decode, step_reward_source=step_reward_source(cfg, decode),
            answer_guard=answer_guard_of(cfg), step_pattern=cfg.process_reward.step_pattern,
            row_layout=row_layout_of(cfg), turn_steps=turn_steps_of(cfg),
            batch_step_rewards=(implicit_prm.run_timed if implicit_prm is not None and implicit_prm.before_sampling
                                else None))
        updater = UpdateRunner(policy, reference, alg, seed=cfg.parallel.seed)

    def run_eval(step: int) -> dict[str, float]:  # async: the rollout world's evaluation of this step's weights
        if feed is not None:
            return feed.evaluation(step) if eval_records else {}
        return run_evaluation(cfg, rollout_engine, eval_records, step,
                              on_completions=implicit_prm.evaluation_metrics if implicit_prm is not None else None)

    with rng_state_kept():  # only an uninterrupted run evaluates before step 1
        eval_metrics = run_eval(0) if start_step == 0 else {}  # a resumed run has its "before" already
    if eval_metrics:
        harness.metrics_log.log(0, eval_metrics, advance=False)

    # parameter and memory figures: once, with the run's first update; not again after a resume (its first row
    # would differ from the uninterrupted run's; the first update's row, kept in metrics.jsonl, has them). The flag
    # is kept in checkpoints; a checkpoint older than it is taken to follow an update, as before the flag.
    if figures.logged is None:
        figures.logged = start_step > 0
    for step in harness.steps():
        timer = Timer()
        # 1. prompts -> G completions -> rewards (per completion, per step) -> dynamic-sampling filter; async: the
        # batch the rollout world made for this step (timing_s/wait: the seconds the trainer waited for it)
        if feed is not None:
            with timer("wait"), failure_phase("waiting for the rollout world"):
                groups, metrics = feed.batch(step)
        else:
            if offload:  # a checkpoint save took the optimizer state back
                _offload_training_state(policy, implicit_prm)
            with timer("gen"), memory.phase("generation"), failure_phase("generation"):
                groups, metrics = rollout.run(step)
            _release_rollout_memory(rollout_engine)
        if implicit_prm is not None and not implicit_prm.before_sampling and len(groups):  # learns, then scores
            with timer("implicit_prm"), failure_phase("implicit PRM"):
                groups, implicit_metrics = implicit_prm.run(groups)
            metrics.update(implicit_metrics)
        if cfg.trainer.dump_rollouts and harness.is_rank0:
            _dump_rollouts(harness.run_dir, step, groups, alg)
        if len(groups) == 0:
            logger.warning("step %d: every sampled group had equal rewards; no update", step)
        else:
            # 2. advantages on prompt + response rows; 3. old / reference log-probs and the updates
            batch = build_training_batch(groups, alg, tokenizer.pad_token_id)
            if offload:
                policy.reload_from_host()
            try:
                with memory.phase("update"), failure_phase("update"):
                    metrics.update(updater.run(batch, len(groups), step, timer))
            except NonFiniteError as error:  # recorded as it was (NaN / Inf), then the run stops naming the step
                harness.fail_step(step, {**metrics, "actor/loss": error.loss, "actor/grad_norm": error.grad_norm})
                raise
            metrics.update(_batch_metrics(groups, batch, alg))
            if not figures.logged:  # once, after Adam's first step allocated its moments (grpo_mega.perf.parameters)
                metrics.update(parameter_figures(policy))
                figures.logged = True
        # 4. weight sync to the rollout engine, also without an update: a sleeping vLLM has discarded its weights;
        # async: the new version goes to the rollout world, which takes it when its schedule needs it
        with timer("sync"), failure_phase("sync", bounded=True):
            if feed is not None:
                sync_metrics = feed.push_weights(step, policy.export_hf_weights())
            else:
                sync = _sync(policy, rollout_engine, cfg, offload=offload, implicit_prm=implicit_prm)
                sync_metrics = {"timing_s/sync": sync.seconds, "perf/sync_bytes": float(sync.bytes)}
        policy.lr_schedule_step()  # the schedule counts trainer steps, however many optimizer steps were taken
        if implicit_prm is not None:
            implicit_prm.lr_schedule_step()
        metrics.update(timer.seconds, **sync_metrics)
        metrics.update(memory.metrics())
        metrics["timing_s/step"] = sum(timer.seconds.values())
        if "perf/num_tokens" in metrics:
            metrics["perf/throughput"] = metrics["perf/num_tokens"] / metrics["timing_s/step"]
        if "timing_s/prm" in metrics:  # the PRM's scoring, inside generation's seconds: its share of the step
            metrics["perf/prm_fraction"] = metrics["timing_s/prm"] / metrics["timing_s/step"]
        if "timing_s/tools" in metrics:  # multi-turn: the tools' wall clock, inside generation's: its share
            metrics["perf/tool_fraction"] = metrics["timing_s/tools"] / metrics["timing_s/step"]

        # 5. evaluation on schedule; then metrics, and a checkpoint on schedule or when a signal or the time limit
        # stops the run early (the harness)
        if harness.on_schedule(step, cfg.trainer.eval_every):
            with failure_phase("evaluation"):
                eval_metrics = run_eval(step)
            metrics.update(eval_metrics)
        harness.end_step(step, metrics)

    if feed is not None:  # the train file's bad rows: the rollout world read it
        harness.skipped_rows.merge(feed.skipped_rows)
    harness.finish(before_shutdown=feed.close if feed is not None
                   else lambda: close_rollout_engine(rollout_engine, rollout))
    return eval_metrics


# ----------------------------------------------------------------------------- set-up
def _build_engines(cfg: GRPOConfig):
    """The policy (trained) and, with the KL loss, the reference (forward-only), with their initial weights still
    to load (``model.init_from``, in :func:`train`)."""
    hf_config = load_model_hf_config(cfg.model)
    shared = dict(
        max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
        logprob_chunk_size=cfg.model.logprob_chunk_size, temperature=cfg.rollout.temperature,
        logits_in_fp32=cfg.model.logits_in_fp32, engine_kind=cfg.engine, deepspeed=cfg.deepspeed,
        share_prompt_prefix=cfg.parallel.share_prompt_prefix,
        sequence_parallel=cfg.parallel.sequence_parallel, recompute=cfg.parallel.recompute,
    )
    policy = build_policy_engine(hf_config, optim=cfg.optim, total_steps=cfg.trainer.total_steps,
                                 distributed_optimizer=cfg.parallel.distributed_optimizer,
                                 routing_replay=cfg.rollout.routing_replay,
                                 attach_adapters=lora_attacher(cfg.model.lora, seed=cfg.parallel.seed,
                                                               base=cfg.model.init_from), **shared)
    if cfg.model.lora.enabled:
        logger.info("LoRA rank %d (alpha %g) on %s: %d trainable parameters, the base frozen",
                    cfg.model.lora.rank, cfg.model.lora.alpha, ", ".join(cfg.model.lora.target_modules),
                    policy.lora.trainable_parameters())
    if not cfg.algorithm.use_kl_loss:
        return policy, None
    # LoRA: the KL reference is the base, i.e. the policy with its adapters off (no second model held)
    reference = AdaptersOffReference(policy) if cfg.model.lora.enabled else build_reference_engine(hf_config, **shared)
    return policy, reference


def _load_initial_weights(policy, source, implicit_prm, cfg: GRPOConfig) -> None:
    """A new run's weights: the policy's (``model.init_from``; with LoRA already loaded as the base) and the
    implicit PRM's, if any (a resumed run has both from its checkpoint)."""
    if not cfg.model.lora.enabled:
        load_initial_weights(policy, source)
    if implicit_prm is not None:
        implicit_prm.load_initial_weights(implicit_prm_source(cfg))


def _release_rollout_memory(rollout_engine) -> None:
    """Free the rollout engine's accelerator memory for the update, where it can (vllm sleep mode on GPUs)."""
    release = getattr(rollout_engine, "release_memory", None)
    if release is not None:
        release()


def _offload_training_state(policy, implicit_prm) -> None:
    """``parallel.offload_during_rollout``: the policy's gradient buffers and optimizer state leave the device, and
    the implicit PRM's (it takes them back when it trains: ``ImplicitPRM.run``)."""
    policy.offload_to_host()
    if implicit_prm is not None:
        implicit_prm.engine.offload_to_host()


def _sync(policy, rollout_engine, cfg: GRPOConfig, *, offload: bool, implicit_prm=None) -> SyncStats:
    """Full weight sync; with ``offload`` the gradient buffers and optimizer state leave the device first, so the
    rollout engine's weights (and then its KV cache) wake into the room they held."""
    if offload:
        _offload_training_state(policy, implicit_prm)
    return sync_weights(policy.export_hf_weights(), rollout_engine, bucket_bytes=cfg.rollout.sync_bucket_mb * 2**20)


# ----------------------------------------------------------------------------- outputs
def _batch_metrics(groups: RolloutBatch, batch: dict[str, torch.Tensor], alg) -> dict[str, float]:
    """verl-style metric names for the trained batch."""
    lengths = batch["response_lengths"].float()
    response_advantages = batch["advantages"][batch["loss_mask"].bool()]
    metrics = {
        "critic/score/mean": float(groups.scores.mean()),
        "critic/score/max": float(groups.scores.max()),
        "critic/score/min": float(groups.scores.min()),
        "critic/rewards/mean": float(groups.rewards.mean()),
        "critic/advantages/mean": float(response_advantages.mean()),
        "critic/advantages/max": float(response_advantages.max()),
        "critic/advantages/min": float(response_advantages.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= alg.response_length).float().mean()),
        "perf/num_tokens": float(batch["attention_mask"].sum()),
        "perf/num_response_tokens": float(batch["loss_mask"].sum()),
        "train/groups": float(len(groups)),
    }
    if groups.step_rewards is not None:
        counts = [len(s) for s in groups.step_rewards]
        all_steps = [r for s in groups.step_rewards for r in s]
        metrics["reward/steps_per_completion"] = sum(counts) / len(counts)
        if all_steps:
            metrics["reward/step_reward_mean"] = sum(all_steps) / len(all_steps)
        if any(c.turns is not None for c in groups.completions):  # turn credit: each assistant turn a step
            metrics.update(turn_credit_metrics(groups, alg))
    return metrics


def _dump_rollouts(run_dir: Path, step: int, groups: RolloutBatch, alg) -> None:
    """``run_dir/rollouts/step_N.jsonl``: one line per trained completion (``trainer.dump_rollouts``); a multi-turn
    rollout's line has its per-token ``advantages`` in response coordinates (0 on tool tokens)."""
    folder = run_dir / ROLLOUTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    G = groups.group_size
    advantages = group_advantages(groups, alg) if len(groups) else None
    with (folder / f"{step_dir_name(step)}.jsonl").open("w", encoding="utf-8") as out:
        for row, completion in enumerate(groups.completions):
            record = groups.records[row // G]
            line = {"prompt": record.prompt, "source": record.source, "response": completion.text,
                    "response_ids": completion.response_ids, "reward": float(groups.rewards[row]),
                    "score": float(groups.scores[row]), "finish_reason": completion.finish_reason}
            if groups.step_rewards is not None:
                line.update(step_rewards=groups.step_rewards[row], step_ends=groups.step_ends[row])
            if completion.tree_path is not None:  # process_reward.source: tree: the nodes the completion went through
                line["tree_path"] = completion.tree_path
            if completion.turns is not None:  # multi-turn: which tokens are the policy's, and the turns' records
                line["response_mask"] = completion.response_mask
                line["advantages"] = advantages[row, :len(completion.response_ids)].tolist()
                line["turns"] = [dataclasses.asdict(turn) for turn in completion.turns]
            out.write(json.dumps(line) + "\n")
