"""The names of the GRPO math's options (what a config may set them to), without the math: the config and the CLI
check a setting against these before anything imports torch, so a mistyped option is refused in a fraction of a
second instead of after torch's import (2-3 s). The modules that implement each option import their names from
here."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""``algorithm.kl_estimator``: Schulman's k1, k2 and k3 estimators (``grpo_mega.algo.kl``)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""``algorithm.loss_agg_mode``: how the token losses of a batch become one number (``grpo_mega.algo.losses``)."""

POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "gmpo", "cispo")
"""``algorithm.policy_loss``: the policy-gradient surrogate (``grpo_mega.algo.policy_losses``): ``ppo`` (token-level
clip, GRPO's), ``gspo`` and ``gspo_token`` (Qwen's sequence-level ratio), ``gmpo`` (geometric mean of clipped token
ratios) and ``cispo`` (MiniMax-M1's clipped, detached importance weight on log pi)."""

SEQUENCE_LEVEL_POLICY_LOSSES = ("gspo", "gspo_token", "gmpo")
"""The forms whose ratio (and clip decision) belongs to a whole sequence: their per-sequence objective is a mean
over sequences, so they take ``loss_agg_mode: seq-mean-token-mean`` only (any other mode would weight a sequence's
one term by its length)."""

PER_SEQUENCE_ADVANTAGE_POLICY_LOSSES = ("gspo", "gmpo")
"""The forms defined for one advantage per sequence only (``algorithm.supervision: outcome``): GSPO multiplies the
sequence ratio by A_i, GMPO takes the geometric mean of the terms r_t A_i, which needs one sign sgn(A_i) per
sequence. ``gspo_token`` and ``cispo`` take per-token advantages (process supervision)."""

POLICY_LOSS_CLIP_KEYS = {
    "ppo": ("clip_low", "clip_high"),
    "gspo": ("gspo_clip_low", "gspo_clip_high"),
    "gspo_token": ("gspo_clip_low", "gspo_clip_high"),
    "gmpo": ("gmpo_clip_low", "gmpo_clip_high"),
    "cispo": ("cispo_clip_low", "cispo_clip_high"),
}
"""The ``algorithm`` keys of each form's clip range (low, high): each form reads its own, with its paper's defaults."""

VERL_LOSS_MODE_NAMES = {"vanilla": "ppo", "geo_mean": "gmpo"}
"""verl's ``actor.policy_loss.loss_mode`` names whose form has another name here (not accepted as values: the
error for one of them names ours)."""

STEP_BASELINES = ("pooled_steps", "completion")
"""``algorithm.step_baseline``: what a step's reward is compared with (``grpo_mega.algo.advantages``)."""

STEP_REWARDS = ("score", "progress", "delta", "clip")
"""``process_reward.step_reward``: how PRM step scores become step rewards (``grpo_mega.algo.step_rewards``)."""

IMPLICIT_STEP_VALUES = ("sum", "probability")
"""``implicit_prm.step_value``: a step's score from its token rewards (``grpo_mega.algo.implicit_reward``)."""

IMPLICIT_STEPS = ("text", "tokens")
"""``implicit_prm.steps``: what the implicit PRM's step rewards are given to: the text's steps
(``process_reward.step_pattern``), or every token through the answer as a step of its own (PRIME's token-level
rewards)."""

IMPLICIT_UPDATE_ORDERS = ("before", "after")
"""``implicit_prm.update``: the update before the scoring (scored by the updated PRM) or after it (scored with the
log-probs of the update's own forward, the PRM before the update)."""

TURN_CREDIT_FORMS = ("bounded", "sum")
"""The turn credit of multi-turn rollouts (``grpo_mega.algo.turn_credit``): ``bounded`` (the outcome advantage
reweighted by a clipped turn term centred within the completion, never flipping its sign) or ``sum`` (DeepSeekMath
suffix sums of group-normalised turn rewards on top of the outcome advantage)."""

MAX_TURNS_OUTCOMES = ("wrong", "as_is")
"""How a rollout stopped at ``max_turns`` is scored by turn credit: as a wrong answer, or with its outcome as it is."""
