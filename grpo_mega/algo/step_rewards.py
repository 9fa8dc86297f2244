"""Step rewards from a PRM's step scores (``process_reward.step_reward``), before the weighting, the outcome term and
the group normalisation of process supervision.

A completion's steps 1..K have PRM scores ``s_1 .. s_K`` in [0, 1]: the PRM's estimate that the solution is still
right (on track to a right answer) after step k. The options:

- ``score``: ``r_k = s_k`` (DeepSeekMath 4.1.3). The suffix sum from step k, ``sum_{j>=k} s_j``, grows with the
  number of steps ahead, so the policy can earn credit by adding correct but useless steps (Gao et al., 2410.15115).
- ``progress`` (PAV, Setlur et al., 2410.08146): ``r_k = s_k - s_{k-1}``, the change in the estimated chance of
  reaching a right answer that step k made, with ``s_0`` the same estimate before any step: the mean outcome score
  of the G completions of the prompt (the policy's Monte-Carlo success rate from the bare prompt, which is what a
  PRM trained on Monte-Carlo labels estimates after each later step; a PRM has no score for an empty solution, and a
  learned value would be a second model to train). The suffix sum from step k telescopes to ``s_K - s_{k-1}``.
- ``delta`` (Gao et al.): ``r_k = s_k - s_{k+1}`` for k < K and ``r_K = s_K``; the suffix sum from step k
  telescopes to ``s_k``: bounded by 1 whatever the number of steps.
- ``clip`` (Gao et al.): ``r_k = min(s_k - eta, 0)`` (``process_reward.clip_eta``): no step earns a positive
  reward, so extra steps can only cost.

All are per completion; a completion without steps has no step rewards. PURE's min-form credit
(``algorithm.step_credit: min``) and the max-steps cap (``process_reward.max_counted_steps``, applied when the steps
are split, before scoring) compose with each.
"""

from __future__ import annotations

import math
from typing import Sequence

from grpo_mega.algo.choices import STEP_REWARDS


def step_rewards_from_scores(scores: Sequence[float], kind: str, *, start: float = 0.0,
                             clip_eta: float = 0.5) -> list[float]:
    """The step rewards of one completion from its PRM step ``scores`` (see the module docstring); ``start`` is
    ``s_0`` for ``progress``, ``clip_eta`` the threshold of ``clip``."""
    scores = [float(s) for s in scores]
    if kind == "score":
        return scores
    if kind == "progress":
        if not math.isfinite(start):
            raise ValueError(f"progress step rewards need a finite s_0, got {start}")
        return [now - before for now, before in zip(scores, [start, *scores[:-1]])]
    if kind == "delta":
        return [now - after for now, after in zip(scores[:-1], scores[1:])] + scores[-1:]
    if kind == "clip":
        return [min(s - clip_eta, 0.0) for s in scores]
    raise ValueError(f"step reward must be one of {STEP_REWARDS}, got {kind!r}")


def group_start_values(prompts: Sequence[str], outcomes: Sequence[float]) -> list[float]:
    """``s_0`` of every completion for ``progress``: the mean outcome score of its group, the run of consecutive
    completions with the same prompt (the rollout lays a prompt's G completions out together)."""
    if len(prompts) != len(outcomes):
        raise ValueError(f"{len(prompts)} prompts but {len(outcomes)} outcome scores")
    starts: list[float] = []
    begin = 0
    for end in range(1, len(prompts) + 1):
        if end == len(prompts) or prompts[end] != prompts[begin]:
            mean = sum(outcomes[begin:end]) / (end - begin)
            starts += [mean] * (end - begin)
            begin = end
    return starts
