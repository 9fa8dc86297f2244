"""The sampler/trainer mismatch: how far the rollout engine's log-probs are from the trainer's, and truncated
importance sampling (TIS) to correct the policy gradient for it.

The rollout engine (vLLM in bf16, other kernels, other reduction orders) samples from ``pi_rollout``, which is not
exactly the trainer's ``pi_old`` even with identical weights. Training on its samples with the trainer's ratio
``pi / pi_old`` is then silently off-policy (Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training", 2025). TIS weights each token's policy loss by the capped ratio ``pi_old / pi_rollout``.
"""

from __future__ import annotations

import torch


def truncated_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token TIS weights ``w = min(exp(old_logp - rollout_logp), cap)``, detached.

    ``old_logp`` are the trainer's log-probs of the sampled tokens under the policy that sampled them (the current
    ones when the update is on-policy), ``rollout_logp`` the sampler's; both [B, T]. The weight is data, not a
    function of the parameters (verl's ``tis_imp_ratio_cap``): no gradient flows through it. Capping from above
    only bounds the variance a token that the sampler found much less likely than the trainer could add. A
    sampler log-prob of ``-inf`` gives ``cap``.
    """
    if not cap > 0:
        raise ValueError(f"the truncated importance weight cap must be > 0, got {cap}")
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} differ")
    with torch.no_grad():
        return torch.exp(old_logp.detach() - rollout_logp.to(old_logp.dtype)).clamp(max=cap)


def rollout_logprob_diff(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's on the same tokens (masked tokens only).

    With ``D = {t : mask_t}``:

    - ``rollout/logprob_diff_mean = mean_{t in D} |trainer_logp_t - rollout_logp_t|``
    - ``rollout/logprob_diff_max  = max_{t in D}  |trainer_logp_t - rollout_logp_t|``
    - ``rollout/probs_diff_mean = mean_{t in D} |exp(trainer_logp_t) - exp(rollout_logp_t)|``
    - ``rollout/probs_diff_max  = max_{t in D}  |exp(trainer_logp_t) - exp(rollout_logp_t)|``

    The ``probs_diff`` pair is verl's ``training/rollout_probs_diff_mean`` / ``_max`` (rollout vs. actor): despite
    its docstring's "logprob diff", verl takes the absolute difference of the *probabilities* ``exp(logp)``, which
    lies in [0, 1] and is dominated by likely tokens. The ``logprob_diff`` pair is the same statistic in log space,
    dominated by unlikely tokens (where bf16 logits lose most). Both are 0 when no token is masked in; the result
    is detached 0-dim fp32 tensors.
    """
    if trainer_logp.shape != rollout_logp.shape or trainer_logp.shape != mask.shape:
        raise ValueError(
            f"trainer_logp {tuple(trainer_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape"
        )
    with torch.no_grad():
        selected = mask.bool()
        trainer = trainer_logp.detach().float()[selected]
        rollout = rollout_logp.detach().float()[selected]
        zero = torch.zeros((), dtype=torch.float32, device=trainer.device)
        if trainer.numel() == 0:
            names = ("logprob_diff_mean", "logprob_diff_max", "probs_diff_mean", "probs_diff_max")
            return {f"rollout/{name}": zero for name in names}
        logprob_diff = (trainer - rollout).abs()
        probs_diff = (trainer.exp() - rollout.exp()).abs()
        return {
            "rollout/logprob_diff_mean": logprob_diff.mean(),
            "rollout/logprob_diff_max": logprob_diff.max(),
            "rollout/probs_diff_mean": probs_diff.mean(),
            "rollout/probs_diff_max": probs_diff.max(),
        }
