"""Per-token estimators of KL(pi || pi_ref) from sampled tokens (Schulman, "Approximating KL divergence")."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate with ``d = ref_logp - logp``.

    - ``k1 = -d`` (unbiased, high variance, can be negative)
    - ``k2 = d**2 / 2`` (biased, low variance)
    - ``k3 = exp(d) - d - 1`` (unbiased, non-negative; DeepSeekMath / GRPO). Its gradient with respect to
      ``logp`` is ``1 - pi_ref / pi``.
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator kind={kind!r}; expected one of {KL_ESTIMATORS}")
