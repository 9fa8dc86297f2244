"""The update runner: old log-probs (when the policy moves within the step), reference log-probs (KL only), then
ppo_epochs x mini-batch optimizer steps through the engine interface, and the step's actor metrics."""

from __future__ import annotations

import torch

from grpo_mega.algo import rollout_logprob_diff
from grpo_mega.algo.choices import POLICY_LOSS_CLIP_KEYS
from grpo_mega.config import AlgorithmConfig
from grpo_mega.engine.base import NonFiniteError
from grpo_mega.engine.batching import slice_rows
from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn


def mini_batch_rows(num_groups: int, group_size: int, groups_per_mini_batch: int, seed: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch: whole groups, shuffled with ``seed``; the last one may be smaller
    (dynamic sampling can leave a number of groups that the mini-batch size does not divide)."""
    order = torch.randperm(num_groups, generator=torch.Generator().manual_seed(seed))
    return [
        (order[start : start + groups_per_mini_batch, None] * group_size + torch.arange(group_size)).flatten()
        for start in range(0, num_groups, groups_per_mini_batch)
    ]


def clip_range(algorithm: AlgorithmConfig) -> tuple[float | None, float]:
    """``(clip_low, clip_high)`` of ``algorithm.policy_loss``: each form reads its own keys."""
    low, high = POLICY_LOSS_CLIP_KEYS[algorithm.policy_loss]
    return getattr(algorithm, low), getattr(algorithm, high)


def loss_settings(algorithm: AlgorithmConfig, *, on_policy: bool) -> GRPOLossSettings:
    clip_low, clip_high = clip_range(algorithm)
    return GRPOLossSettings(
        policy_loss=algorithm.policy_loss, clip_low=clip_low, clip_high=clip_high,
        dual_clip=algorithm.dual_clip_loss,
        loss_agg_mode=algorithm.loss_agg_mode, norm_length=algorithm.response_length,
        kl_coef=algorithm.kl_loss_coef if algorithm.use_kl_loss else 0.0, kl_estimator=algorithm.kl_estimator,
        kl_log_ratio_clamp=algorithm.kl_log_ratio_clamp, entropy_coef=algorithm.entropy_coef,
        rollout_is=algorithm.rollout_is, rollout_is_cap=algorithm.rollout_is_cap, on_policy=on_policy,
    )


class UpdateRunner:
    """Trains the policy on one step's batch. ``reference`` is a forward-only engine, or None without KL."""

    def __init__(self, policy, reference, algorithm: AlgorithmConfig, *, seed: int):
        self.policy, self.reference, self.algorithm, self.seed = policy, reference, algorithm, seed
        self.loss_fns = {on: grpo_loss_fn(loss_settings(algorithm, on_policy=on)) for on in (True, False)}

    def run(self, batch: dict[str, torch.Tensor], num_groups: int, step: int, timer) -> dict[str, float]:
        """ppo_epochs passes of mini-batch updates; returns actor metrics averaged over the optimizer steps.

        One update per batch (one epoch, one mini-batch) is on-policy: the loss takes the current log-probs,
        detached, as the old ones and no extra forward pass is spent. Raises NonFiniteError naming ``step``
        when a loss or gradient norm is not finite (the engine has not applied that optimizer step)."""
        alg, G = self.algorithm, self.algorithm.num_return_sequences_in_group
        groups_per_mini_batch = alg.mini_batch_size or alg.rollout_batch_size
        plans = [mini_batch_rows(num_groups, G, groups_per_mini_batch, seed=self.seed + step * 1000 + epoch)
                 for epoch in range(alg.ppo_epochs)]
        on_policy = alg.ppo_epochs == 1 and len(plans[0]) == 1
        metrics: dict[str, float] = {}
        if not on_policy:
            with timer("old_logprob"):
                batch["old_logprobs"], _ = self.policy.forward_logprobs(batch, loss_tokens_only=True)
            diff = rollout_logprob_diff(batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"])
            metrics.update({name: float(value) for name, value in diff.items()})
        if self.reference is not None:
            with timer("ref"):
                batch["ref_logprobs"], _ = self.reference.forward_logprobs(batch, loss_tokens_only=True)
        updates = []
        with timer("update"):
            for rows_of_epoch in plans:
                for rows in rows_of_epoch:
                    mini_batch = slice_rows(batch, rows, batch["input_ids"].shape[1])
                    try:
                        updates.append(self.policy.train_step(mini_batch, self.loss_fns[on_policy]))
                    except NonFiniteError as error:
                        error.args = (f"step {step} (optimizer step {len(updates) + 1} of the step): {error}",)
                        raise
        metrics.update(_average_updates(updates))
        metrics["actor/optimizer_steps"] = float(len(updates))
        return metrics


def _average_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """verl-style names for the engine's per-update records: averaged over the step's optimizer steps (the
    maximum for ``*_max``)."""
    averaged = {
        k: max(u[k] for u in updates) if k.endswith("_max") else sum(u[k] for u in updates) / len(updates)
        for k in updates[0]
    }
    renamed = {"grad_norm": "actor/grad_norm", "lr": "actor/lr", "padding_fraction": "perf/padding_fraction",
               "loss": "actor/loss", "layer_tokens": "perf/layer_tokens"}
    averaged.pop("step_seconds", None)
    return {renamed.get(k, k): v for k, v in averaged.items()}
