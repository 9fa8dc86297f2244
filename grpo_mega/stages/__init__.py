"""The stages of one GRPO step, in the order ``grpo_mega.trainer`` calls them:

1. :class:`RolloutStage` (``rollout.py``): prompts -> G completions each -> rewards (per completion, and per step
   from the reward function or a PRM, ``process_reward.py``) -> dynamic-sampling filter, as a :class:`RolloutBatch`;
2. :func:`build_training_batch` (``training_batch.py``): advantages (outcome or process supervision) laid out on
   the engine's ``prompt + response`` rows;
3. :class:`UpdateRunner` (``update.py``): old / reference log-probs, then ppo_epochs x mini-batch updates.

It also holds ``grpo_loss`` (the GRPO loss on one micro-batch, for the engine) and ``evaluation`` (held-out
accuracy through the rollout engine). It may import ``algo``, ``config``, ``data``, ``engine``, ``parallel``,
``reward``, ``rollout``, ``run`` and the PRM library (step rewards); the trainers and ``grpo-mega eval`` import it.
"""

from grpo_mega.stages.rollout import RolloutBatch, RolloutStage
from grpo_mega.stages.training_batch import build_training_batch, group_advantages
from grpo_mega.stages.update import UpdateRunner

__all__ = ["RolloutBatch", "RolloutStage", "UpdateRunner", "build_training_batch", "group_advantages"]
