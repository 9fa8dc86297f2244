"""Outcome-supervised GRPO: ``grpo-mega train --config FILE [key=value ...]``.

One step, top to bottom (``train``):
prompts -> G completions each (rollout engine, split over ranks) -> rewards -> [dynamic sampling: drop groups with
equal rewards, sample more] -> advantages (``grpo_mega.algo``) -> old log-probs (skipped when the policy has not
moved since sampling) -> reference log-probs (only with the KL loss) -> ppo_epochs x mini-batch updates (Megatron
engine) -> weight sync to the rollout engine -> metrics -> checkpoint / eval on schedule.
Every rank runs this loop on the same data (SPMD); the engine shards rows over data-parallel ranks itself.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from grpo_mega.checkpoint.training import CheckpointManager, load_model_only
from grpo_mega.checkpoint.training_files import weights_format
from grpo_mega.config import GRPOConfig, save_config
from grpo_mega.data.prompts import PromptBatches, load_prompt_dataset
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.engine import build_policy_engine
from grpo_mega.engine.batching import slice_rows
from grpo_mega.evaluation import evaluate
from grpo_mega.grpo_loss import GRPOLossSettings, grpo_loss_fn
from grpo_mega.metrics import MetricsLogger
from grpo_mega.parallel import destroy_distributed, init_distributed
from grpo_mega.reward import get_reward_function
from grpo_mega.rollout import SamplingConfig, build_rollout_engine, sync_weights
from grpo_mega.rollout.distributed import generate_across_ranks
from grpo_mega.rollout_scoring import (
    compute_advantages,
    concat_groups,
    keep_informative_groups,
    score_groups,
    take_groups,
    training_batch,
)

logger = logging.getLogger(__name__)


class Timer:
    """Wall-clock seconds per phase of a step, reported as ``timing_s/<phase>``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{phase}"] = self.seconds.get(f"timing_s/{phase}", 0.0) + time.perf_counter() - start


def _load_initial_weights(engine, cfg: GRPOConfig) -> None:
    """``model.init_from``: a grpo-mega checkpoint (or run directory), or an HF folder with safetensors."""
    source = cfg.model.init_from
    if source is None:
        logger.warning("model.init_from is not set: GRPO starts from random weights")
        return
    kind = weights_format(source)
    if kind == "hf":
        from grpo_mega.checkpoint.hf_convert import load_hf_weights
        from grpo_mega.checkpoint.hf_io import HFWeights

        load_hf_weights(engine.stage, HFWeights(source), engine.hf_config)
    elif kind == "mcore_model":
        from grpo_mega.checkpoint.mcore_checkpoint import load_mcore_checkpoint

        load_mcore_checkpoint(engine.stage, source)
    else:
        load_model_only(engine, source)
        return
    engine.optimizer.reload_model_params()  # bf16: the fp32 master copies follow the loaded weights


def _sync(policy, rollout, bucket_mb: int) -> float:
    stats = sync_weights(policy.export_hf_weights(), rollout, bucket_bytes=bucket_mb * 2**20)
    return stats.seconds


def _mini_batches(num_groups: int, group_size: int, cfg: GRPOConfig, epoch_seed: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch: whole groups, shuffled per epoch."""
    per_mini = cfg.algorithm.mini_batch_size or num_groups
    order = torch.randperm(num_groups, generator=torch.Generator().manual_seed(epoch_seed))
    batches = []
    for start in range(0, num_groups, per_mini):
        groups = order[start : start + per_mini]
        batches.append((groups[:, None] * group_size + torch.arange(group_size)).flatten())
    return batches


def train(cfg: GRPOConfig) -> dict[str, float]:
    """Run GRPO; returns the last evaluation metrics."""
    alg, G = cfg.algorithm, cfg.algorithm.num_return_sequences_in_group
    init_distributed(cfg.parallel.tensor, cfg.parallel.pipeline, seed=cfg.parallel.seed)
    is_rank0 = dist.get_rank() == 0
    run_dir = Path(cfg.trainer.run_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_config)
    hf_config = AutoConfig.from_pretrained(cfg.model.hf_config)

    # Data and rewards
    def prompts_from(path):
        return load_prompt_dataset(
            path, tokenizer, prompt_length=cfg.data.prompt_length, prompt_field=cfg.data.prompt_field,
            answer_field=cfg.data.answer_field, on_bad_row=cfg.data.on_bad_row, use_chat_template=cfg.data.chat_template,
        ).records

    train_prompts = PromptBatches(prompts_from(cfg.data.train_file), alg.rollout_batch_size, seed=cfg.parallel.seed)
    eval_prompts = prompts_from(cfg.data.eval_file)[: cfg.data.max_eval_prompts] if cfg.data.eval_file else []
    reward_fn = get_reward_function(cfg.reward.function)
    format_fn = get_reward_function(cfg.reward.format_function) if cfg.reward.format_weight else None

    # Engines: the policy (Megatron), the reference (frozen, KL only), the rollout engine on every rank
    mini_batches_per_epoch = alg.rollout_batch_size // (alg.mini_batch_size or alg.rollout_batch_size)
    engine_args = dict(
        optim=cfg.optim, total_steps=cfg.trainer.total_steps * alg.ppo_epochs * mini_batches_per_epoch,
        max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
        logprob_chunk_size=cfg.model.logprob_chunk_size, temperature=cfg.rollout.temperature,
    )
    policy = build_policy_engine(hf_config, **engine_args)
    _load_initial_weights(policy, cfg)
    reference = None
    if alg.use_kl_loss:
        reference = build_policy_engine(hf_config, **engine_args)
        _load_initial_weights(reference, cfg)
    checkpoints = CheckpointManager(run_dir, keep_last=cfg.trainer.keep_last)
    start_step = 0
    resume_from = checkpoints.find_resume(cfg.trainer.resume)
    if resume_from is not None:
        loaded = checkpoints.load(policy, resume_from, seed=cfg.parallel.seed)
        start_step = loaded.step
        train_prompts.load_state_dict(loaded.extra_state["prompts"])
        logger.info("resumed from %s at step %d", resume_from, start_step)
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    rollout = build_rollout_engine(
        cfg.rollout.engine, model_path=cfg.model.hf_config, tokenizer=tokenizer,
        dtype="float32" if not torch.cuda.is_available() else "bfloat16",
        **({"generation_batch_size": cfg.rollout.generation_batch_size} if cfg.rollout.engine == "hf" else
           {"gpu_memory_utilization": cfg.rollout.gpu_memory_utilization}),
    )
    sync_seconds = _sync(policy, rollout, cfg.rollout.sync_bucket_mb)
    sampling = SamplingConfig(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_new_tokens=alg.response_length, stop=list(cfg.rollout.stop), n=G,
    )

    def run_eval(step: int) -> dict[str, float]:
        if not eval_prompts:
            return {}
        return evaluate(
            rollout, eval_prompts, reward_fn, max_new_tokens=alg.response_length, stop=cfg.rollout.stop,
            temperature=cfg.trainer.eval_temperature, seed=cfg.parallel.seed + step,
        )

    loss_fn = grpo_loss_fn(GRPOLossSettings(
        clip_low=alg.clip_low, clip_high=alg.clip_high, dual_clip=alg.dual_clip_loss,
        loss_agg_mode=alg.loss_agg_mode, norm_length=alg.response_length,
        kl_coef=alg.kl_loss_coef if alg.use_kl_loss else 0.0, kl_estimator=alg.kl_estimator,
        entropy_coef=alg.entropy_coef, on_policy=loss_fn_on_policy(alg, mini_batches_per_epoch),
    ))
    metrics_log = MetricsLogger(
        run_dir, total_steps=cfg.trainer.total_steps, start_step=start_step, active=is_rank0,
        tensorboard=cfg.trainer.tensorboard, progress_bar=cfg.trainer.progress_bar,
    )
    eval_metrics: dict[str, float] = {}
    if start_step == 0:  # the "before" of the run; a resumed run has it in its metrics already
        eval_metrics = run_eval(0)
        if eval_metrics:
            metrics_log.log(0, eval_metrics, advance=False)

    def end_of_step(step: int, metrics: dict[str, float]) -> None:
        """Checkpoint and evaluate on schedule (also after a step with nothing to train on), then log."""
        nonlocal eval_metrics
        if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 or step == cfg.trainer.total_steps:
            checkpoints.save(policy, step, extra_state={"prompts": train_prompts.state_dict()}, config=asdict(cfg))
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 or step == cfg.trainer.total_steps:
            eval_metrics = run_eval(step)
            metrics.update(eval_metrics)
        metrics_log.log(step, metrics)

    for step in range(start_step + 1, cfg.trainer.total_steps + 1):
        timer = Timer()
        metrics: dict[str, float] = {"timing_s/sync": sync_seconds}

        # 1. prompts -> G completions -> rewards; dynamic sampling refills groups whose rewards were all equal
        with timer("gen"):
            groups, sampled_scores = None, []
            for round_index in range(alg.max_sampling_rounds if alg.dynamic_sampling else 1):
                records = next(train_prompts)
                completions = generate_across_ranks(
                    rollout, [r.prompt_ids for r in records], sampling,
                    call_seed=cfg.parallel.seed * 1_000_003 + step * 101 + round_index,
                )
                scored = score_groups(records, completions, reward_fn, group_size=G, algorithm=alg,
                                      format_fn=format_fn, format_weight=cfg.reward.format_weight)
                sampled_scores.append(scored.scores)
                if alg.dynamic_sampling:
                    scored = keep_informative_groups(scored, G)
                groups = scored if groups is None else concat_groups(groups, scored)
                if len(groups) >= alg.rollout_batch_size:
                    break
            groups = take_groups(groups, min(len(groups), alg.rollout_batch_size), G)
        sampled_scores = torch.cat(sampled_scores)
        # critic/score/* describe the trained batch (after dynamic sampling, as in verl); this is every sample drawn.
        metrics["rollout/sampled_score/mean"] = float(sampled_scores.mean())
        metrics["rollout/kept_group_fraction"] = len(groups) * G / max(len(sampled_scores), 1)
        if len(groups) == 0:
            logger.warning("step %d: every sampled group had equal rewards; no update", step)
            metrics.update(timer.seconds)
            end_of_step(step, metrics)
            continue

        # 2. advantages -> the training batch
        advantages = compute_advantages(groups.rewards, G, alg)
        batch = training_batch(groups, advantages, tokenizer.pad_token_id)

        # 3. old log-probs (only when the policy moves during this step) and reference log-probs (KL only)
        if not loss_fn_on_policy(alg, mini_batches_per_epoch):
            with timer("old_logprob"):
                batch["old_logprobs"], _ = policy.forward_logprobs(batch)
        if reference is not None:
            with timer("ref"):
                batch["ref_logprobs"], _ = reference.forward_logprobs(batch)

        # 4. ppo_epochs x mini-batches of updates
        with timer("update"):
            updates = []
            for epoch in range(alg.ppo_epochs):
                for rows in _mini_batches(len(groups), G, cfg, epoch_seed=step * 1000 + epoch):
                    mini_batch = slice_rows(batch, rows, batch["input_ids"].shape[1])
                    updates.append(policy.train_step(mini_batch, loss_fn))

        # 5. weight sync to the rollout engine
        with timer("sync"):
            sync_seconds = _sync(policy, rollout, cfg.rollout.sync_bucket_mb)

        # 6. metrics, checkpoint, evaluation
        metrics.update(_step_metrics(groups, advantages, batch, updates, alg))
        metrics.update(timer.seconds)
        metrics["timing_s/step"] = sum(timer.seconds.values())
        metrics["perf/num_tokens"] = float(batch["attention_mask"].sum())
        metrics["perf/num_response_tokens"] = float(batch["loss_mask"].sum())
        metrics["perf/throughput"] = metrics["perf/num_tokens"] / metrics["timing_s/step"]
        end_of_step(step, metrics)

    metrics_log.close()
    destroy_distributed()
    return eval_metrics


def loss_fn_on_policy(alg, mini_batches_per_epoch: int) -> bool:
    """One update per rollout batch: the policy that sampled is the policy that is updated."""
    return alg.ppo_epochs == 1 and mini_batches_per_epoch == 1


def _step_metrics(groups, advantages, batch, updates: list[dict], alg) -> dict[str, float]:
    """verl-style metric names for one step."""
    lengths = batch["response_lengths"].float()
    averaged = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    metrics = {
        "critic/score/mean": float(groups.scores.mean()),
        "critic/score/max": float(groups.scores.max()),
        "critic/score/min": float(groups.scores.min()),
        "critic/rewards/mean": float(groups.rewards.mean()),
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= alg.response_length).float().mean()),
        "actor/grad_norm": averaged.pop("grad_norm"),
        "actor/lr": averaged.pop("lr"),
        "perf/padding_fraction": averaged.pop("padding_fraction"),
    }
    averaged.pop("step_seconds", None)
    averaged.pop("loss", None)
    metrics.update(averaged)
    return metrics
