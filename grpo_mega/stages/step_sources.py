"""Where process supervision's step rewards come from (``process_reward.source``): one builder per source, registered
by name, as verl registers its advantage estimators.

A builder takes the run's config and the completion decoder and returns the source the rollout stage calls, or None
when the rollout stage needs nothing of its own:

- the source is called as ``source(prompts, texts, outcome scores, rows' extra fields, completions=...)`` and returns
  (step rewards, step ends as character offsets, metrics) for every completion (``PRMStepRewards`` is the model);
- a source that changes how a group is sampled carries a ``sampler`` with ``generate(engine, prompt_ids, sampling,
  call_seed=...)``, which the rollout stage calls instead of ``generate_across_ranks`` (the tree).

A new source is one module and one ``@register_step_reward_source("name")`` here, plus its name in
``grpo_mega.config.PROCESS_REWARD_SOURCES`` (the config's checks cannot import this module; a test keeps the two
equal).
"""

from __future__ import annotations

from typing import Callable

from grpo_mega.config import GRPOConfig
from grpo_mega.stages.answer_guard import answer_guard_of

STEP_REWARD_SOURCES: dict[str, Callable] = {}
"""{``process_reward.source``: builder(cfg, decode) -> the rollout stage's step-reward source, or None}."""


def register_step_reward_source(name: str) -> Callable[[Callable], Callable]:
    def register(builder: Callable) -> Callable:
        if name in STEP_REWARD_SOURCES:
            raise ValueError(f"step-reward source {name!r} is registered twice")
        STEP_REWARD_SOURCES[name] = builder
        return builder
    return register


def build_step_reward_source(cfg: GRPOConfig, decode: Callable[[list[int]], str]):
    """The step-reward source of ``cfg.process_reward.source`` (None: the rollout stage needs none)."""
    return STEP_REWARD_SOURCES[cfg.process_reward.source](cfg, decode)


@register_step_reward_source("function")
def _reward_function(cfg: GRPOConfig, decode):
    """The reward function's own ``StepRewards`` (``synthetic_steps``: the task's step checker, an oracle PRM): the
    rollout stage reads them from its results and applies the answer guard itself."""
    return None


@register_step_reward_source("prm")
def _learned_prm(cfg: GRPOConfig, decode):
    """A PRM on its own forward-only engine of the policy's kind (``grpo_mega.stages.process_reward``)."""
    from grpo_mega.stages.process_reward import build_prm_step_rewards

    prm = build_prm_step_rewards(cfg.process_reward, max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                                 engine_kind=cfg.engine, deepspeed=cfg.deepspeed, answer_guard=answer_guard_of(cfg))
    if cfg.process_reward.steps == "turns":  # each assistant turn a step (grpo_mega.stages.turn_rewards)
        from grpo_mega.stages.turn_rewards import PRMTurnRewards

        return PRMTurnRewards(prm.scorer, cfg.process_reward, decode)
    return prm


@register_step_reward_source("tool")
def _tools(cfg: GRPOConfig, decode):
    """The tools' own verdicts on each assistant turn's calls (``process_reward.steps: turns``;
    ``grpo_mega.stages.turn_rewards``)."""
    from grpo_mega.stages.turn_rewards import ToolTurnRewards

    return ToolTurnRewards(cfg.process_reward)


@register_step_reward_source("implicit")
def _implicit_prm(cfg: GRPOConfig, decode):
    """PRIME's implicit PRM is a trained engine beside the policy: the trainer builds, updates and checkpoints it
    (``grpo_mega.stages.implicit_prm``) and it scores the batch after the rollout stage (or inside it through the
    stage's ``batch_step_rewards`` hook), so the rollout stage has no source of its own."""
    return None


@register_step_reward_source("tree")
def _tree(cfg: GRPOConfig, decode):
    """Each group sampled as a tree, its segments scored by their nodes' Monte-Carlo values
    (``grpo_mega.stages.tree_rollout``); with ``process_reward.steps: turns`` the tree branches at turn boundaries
    and scores each turn (``grpo_mega.stages.turn_tree``)."""
    if cfg.process_reward.steps == "turns":
        from grpo_mega.stages.turn_tree import TurnTreeRewards, TurnTreeSampler

        sampler = TurnTreeSampler(cfg.tree_rollout.branching, cfg.rollout.multi_turn.max_turns, decode)
        return TurnTreeRewards(sampler, cfg.process_reward)
    from grpo_mega.stages.tree_rollout import TreeSampler, TreeStepRewards

    sampler = TreeSampler(cfg.tree_rollout.branching, cfg.tree_rollout.segment_tokens, decode)
    return TreeStepRewards(sampler, cfg.process_reward, answer_guard_of(cfg))
