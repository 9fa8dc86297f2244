"""The names of the GRPO math's options (what a config may set them to), without the math: the config and the CLI
check a setting against these before anything imports torch, so a mistyped option is refused in a fraction of a
second instead of after torch's import (2-3 s). The modules that implement each option import their names from
here."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""``algorithm.kl_estimator``: Schulman's k1, k2 and k3 estimators (``grpo_mega.algo.kl``)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""``algorithm.loss_agg_mode``: how the token losses of a batch become one number (``grpo_mega.algo.losses``)."""

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
