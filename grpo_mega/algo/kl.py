"""Per-token estimators of KL(pi || pi_ref) from sampled tokens (Schulman, "Approximating KL divergence")."""

from __future__ import annotations

import torch

from grpo_mega.algo.choices import KL_ESTIMATORS

DEFAULT_LOG_RATIO_CLAMP = 20.0
"""|d| bound of the KL log-ratio (verl's bound): exp(20) ~ 4.9e8 keeps k3 finite in fp32 (and in bf16)."""


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str,
    *,
    log_ratio_clamp: float | None = DEFAULT_LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """Per-token KL estimate with the clamped log-ratio ``d = clamp(ref_logp - logp, -c, c)``, ``c = log_ratio_clamp``.

    - ``k1 = -d`` (unbiased, high variance, can be negative)
    - ``k2 = d**2 / 2`` (biased, low variance)
    - ``k3 = exp(d) - d - 1`` (unbiased, non-negative; DeepSeekMath / GRPO). Its gradient with respect to
      ``logp`` is ``1 - pi_ref / pi``.

    The clamp (as in verl's ``kl_penalty``) keeps ``k3`` finite when the policy has moved far below the reference
    on a token (``d`` large: ``exp(100)`` overflows fp32 to inf and poisons the step's loss and gradient). Where
    ``|ref_logp - logp| > c`` the estimate is the constant at the bound and its gradient is 0; within the bound
    the estimators are unchanged. The same ``d`` feeds every estimator. ``log_ratio_clamp=None`` disables the clamp.
    """
    if log_ratio_clamp is not None and not log_ratio_clamp > 0:
        raise ValueError(f"log_ratio_clamp must be positive or None, got {log_ratio_clamp}")
    d = ref_logp - logp
    if log_ratio_clamp is not None:
        d = d.clamp(-log_ratio_clamp, log_ratio_clamp)
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator kind={kind!r}; expected one of {KL_ESTIMATORS}")
