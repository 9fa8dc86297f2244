"""The checks of a whole GRPO or SFT config that span its sections (what typed fields cannot express); run by
``load_config`` as the validator of ``GRPOConfig`` (:func:`validate`) and ``SFTConfig`` (:func:`validate_sft`)."""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

from grpo_mega.algo.choices import (IMPLICIT_STEP_VALUES, IMPLICIT_STEPS, IMPLICIT_UPDATE_ORDERS, KL_ESTIMATORS,
                                   LOSS_AGG_MODES, POLICY_LOSSES, STEP_BASELINES, STEP_REWARDS)
from grpo_mega.config.checks import (
    DECAY_STYLES,
    check_choice,
    check_context_length,
    launched_world_size,
    model_config_json,
    num_experts,
    validate_decode_graphs,
    validate_engine,
    validate_experts,
    validate_optim,
    validate_parallel,
    validate_trainer_common,
    validate_world_size,
)
from grpo_mega.config.grpo import PROCESS_REWARD_SOURCES, STEP_CREDITS, GRPOConfig
from grpo_mega.config.loading import ConfigError
from grpo_mega.config.policy_loss_checks import refuse_verl_loss_mode_name, validate_policy_loss
from grpo_mega.config.sft import SFTConfig
from grpo_mega.config.turn_checks import validate_turn_credit
from grpo_mega.data.formats import FORMATS as DATA_FORMATS

logger = logging.getLogger(__name__)

PRM_SHAPING_DEFAULTS = {"outcome_on_last_step": False, "step_score_weight": 1.0, "max_counted_steps": 0,
                        "min_steps": 0, "step_reward": "score"}
"""``process_reward`` options that shape a PRM's step scores, with their defaults: they mean nothing without a PRM
(``process_reward.source=function``), where they are reset to these with a warning."""


def validate(cfg: GRPOConfig, world_size: int | None = None) -> None:
    """Cross-field checks that typed fields cannot express. ``world_size``: the processes of the job (the CLI's
    ``--nproc`` before it starts them; None: the launcher's, read from the environment; 0: not known)."""
    alg = cfg.algorithm
    validate_engine(cfg)
    validate_optim(cfg.optim)
    validate_trainer_common(cfg.trainer)
    validate_parallel(cfg.parallel)
    check_choice(alg.loss_agg_mode, LOSS_AGG_MODES, "algorithm.loss_agg_mode")
    check_choice(alg.kl_estimator, KL_ESTIMATORS, "algorithm.kl_estimator")
    refuse_verl_loss_mode_name(alg)
    check_choice(alg.policy_loss, POLICY_LOSSES, "algorithm.policy_loss")
    check_choice(cfg.rollout.engine, ("auto", "hf", "vllm"), "rollout.engine")
    validate_decode_graphs(cfg)
    if cfg.parallel.offload_during_rollout and cfg.engine != "megatron":
        raise ConfigError("parallel.offload_during_rollout applies to engine=megatron; with engine=deepspeed use "
                          "deepspeed.offload_optimizer")
    world_size = launched_world_size() if world_size is None else world_size
    validate_rollout_layout(cfg, world_size)
    validate_rollout_mode(cfg, world_size)
    if cfg.rollout.mode != "async":
        validate_world_size(cfg.parallel, world_size)
    check_choice(cfg.data.on_bad_row, ("skip", "error"), "data.on_bad_row")
    validate_prompt_fields(cfg)
    check_choice(cfg.reward.on_error, ("zero", "raise"), "reward.on_error")
    check_choice(alg.rollout_is, ("none", "tis"), "algorithm.rollout_is")
    check_choice(alg.supervision, ("outcome", "process"), "algorithm.supervision")
    check_choice(alg.step_credit, STEP_CREDITS, "algorithm.step_credit")
    check_choice(alg.step_baseline, STEP_BASELINES, "algorithm.step_baseline")
    validate_policy_loss(alg, _speaks())
    if not alg.step_baseline_min_std > 0:
        raise ConfigError(f"algorithm.step_baseline_min_std={alg.step_baseline_min_std} must be > 0")
    validate_answer_guard(cfg)
    check_choice(cfg.process_reward.source, PROCESS_REWARD_SOURCES, "process_reward.source")
    check_choice(cfg.process_reward.on_error, ("raise", "zero"), "process_reward.on_error")
    validate_prm_scorer(cfg.process_reward)
    if cfg.process_reward.layout is not None:
        check_choice(cfg.process_reward.layout, ("classifier", "lm_tokens", "likelihood"), "process_reward.layout")
    if cfg.process_reward.source == "prm":
        if alg.supervision != "process":
            raise ConfigError("process_reward.source=prm needs algorithm.supervision=process")
        if not cfg.process_reward.prm:
            raise ConfigError("process_reward.source=prm needs process_reward.prm (a PRM checkpoint or HF PRM folder)")
        if cfg.process_reward.layout is None and Path(cfg.process_reward.prm).exists():
            from prm.spec import check_layout_is_known

            try:
                check_layout_is_known(cfg.process_reward.prm, "process_reward.layout")
            except ValueError as error:
                raise ConfigError(str(error)) from None
    if cfg.process_reward.likelihood_tokens is not None:
        check_choice(cfg.process_reward.likelihood_tokens, ("all", "result"), "process_reward.likelihood_tokens")
    for key in ("max_counted_steps", "min_steps"):
        if getattr(cfg.process_reward, key) < 0:
            raise ConfigError(f"process_reward.{key} must be >= 0")
    check_choice(cfg.process_reward.step_reward, STEP_REWARDS, "process_reward.step_reward")
    if not 0 <= cfg.process_reward.clip_eta <= 1:
        raise ConfigError(f"process_reward.clip_eta={cfg.process_reward.clip_eta} must be in [0, 1] (PRM scores are)")
    if not cfg.process_reward.step_score_weight >= 0:
        raise ConfigError(f"process_reward.step_score_weight={cfg.process_reward.step_score_weight} must be >= 0")
    validate_implicit_prm(cfg)
    validate_tree_rollout(cfg)
    validate_multi_turn(cfg)
    validate_turn_credit(cfg)
    ignore_prm_shaping_without_prm(cfg)
    validate_reward_functions(cfg)
    if alg.rollout_is_cap <= 0:
        raise ConfigError(f"algorithm.rollout_is_cap={alg.rollout_is_cap} must be > 0")
    if alg.kl_log_ratio_clamp <= 0:
        raise ConfigError(f"algorithm.kl_log_ratio_clamp={alg.kl_log_ratio_clamp} must be > 0")
    if alg.scale_by_std and alg.num_return_sequences_in_group < 2:
        raise ConfigError("algorithm.num_return_sequences_in_group must be >= 2 with algorithm.scale_by_std=true")
    if alg.mini_batch_size and alg.rollout_batch_size % alg.mini_batch_size:
        raise ConfigError(
            f"algorithm.mini_batch_size={alg.mini_batch_size} must divide "
            f"algorithm.rollout_batch_size={alg.rollout_batch_size}"
        )
    if alg.dynamic_sampling and alg.max_sampling_rounds < 1:
        raise ConfigError(f"algorithm.max_sampling_rounds={alg.max_sampling_rounds} must be >= 1 with "
                          "algorithm.dynamic_sampling=true")
    if alg.dual_clip_loss is not None and alg.dual_clip_loss <= 1:
        raise ConfigError(f"algorithm.dual_clip_loss={alg.dual_clip_loss} must be > 1")
    for key in ("response_length", "rollout_batch_size", "ppo_epochs"):
        if getattr(alg, key) < 1:
            raise ConfigError(f"algorithm.{key}={getattr(alg, key)} must be >= 1")
    if alg.overlong_buffer >= alg.response_length:
        raise ConfigError(f"algorithm.overlong_buffer={alg.overlong_buffer} must be smaller than "
                          f"algorithm.response_length={alg.response_length}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 for sampling")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError("rollout.top_p must be in (0, 1]")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(cfg.rollout, key) is not None and getattr(cfg.rollout, key) < 1:
            raise ConfigError(f"rollout.{key}={getattr(cfg.rollout, key)} must be >= 1 (or null: vLLM's default)")
    if cfg.data.prompt_length < 1:
        raise ConfigError(f"data.prompt_length={cfg.data.prompt_length} must be >= 1")
    validate_experts(cfg.model, cfg.parallel)
    validate_routing_replay(cfg)
    check_context_length(cfg.model, cfg.data.prompt_length + alg.response_length,
                          "data.prompt_length + algorithm.response_length")


def ignore_prm_shaping_without_prm(cfg: GRPOConfig) -> None:
    """Without a PRM (``process_reward.source=function``) the options that shape a PRM's scores apply to nothing:
    reset them to their defaults with a one-line warning, so that switching a PRM config to outcome supervision or
    to the task's step function (``algorithm.supervision=outcome process_reward.source=function``) is one switch."""
    if cfg.process_reward.source in ("prm", "implicit", "tree"):
        return
    changed = [key for key, default in PRM_SHAPING_DEFAULTS.items() if getattr(cfg.process_reward, key) != default]
    if not changed:
        return
    settings = ", ".join(f"process_reward.{key}={getattr(cfg.process_reward, key)}" for key in changed)
    for key in changed:
        setattr(cfg.process_reward, key, PRM_SHAPING_DEFAULTS[key])
    if _speaks():
        logger.warning("ignoring %s: it shapes a PRM's step scores and process_reward.source=%s uses no PRM",
                       settings, cfg.process_reward.source)


def validate_implicit_prm(cfg: GRPOConfig) -> None:
    """``process_reward.source=implicit``: process supervision on the megatron engine, the order it runs in (before
    dynamic sampling: the synchronous loop only), and the ``implicit_prm`` section's values."""
    settings = cfg.implicit_prm
    check_choice(settings.step_value, IMPLICIT_STEP_VALUES, "implicit_prm.step_value")
    check_choice(settings.steps, IMPLICIT_STEPS, "implicit_prm.steps")
    check_choice(settings.update, IMPLICIT_UPDATE_ORDERS, "implicit_prm.update")
    if cfg.process_reward.source != "implicit":
        return
    if cfg.algorithm.supervision != "process":
        raise ConfigError("process_reward.source=implicit needs algorithm.supervision=process")
    if cfg.rollout.mode == "async" and settings.before_dynamic_sampling:
        raise ConfigError("implicit_prm.before_dynamic_sampling=true runs the implicit PRM inside the rollout stage, "
                          "which rollout.mode=async moves to the rollout ranks (the implicit PRM trains on the "
                          "trainer's): set implicit_prm.before_dynamic_sampling=false or rollout.mode=colocated")
    if cfg.engine != "megatron":
        raise ConfigError(f"process_reward.source=implicit needs engine=megatron (got engine={cfg.engine})")
    if not settings.beta > 0:
        raise ConfigError(f"implicit_prm.beta={settings.beta} must be > 0")
    check_choice(settings.optim.decay_style, DECAY_STYLES, "implicit_prm.optim.decay_style")
    validate_optim(settings.optim, "implicit_prm.optim")
    if not 0 <= settings.accuracy_low <= settings.accuracy_high <= 1:
        raise ConfigError(f"implicit_prm.accuracy_low={settings.accuracy_low} and implicit_prm.accuracy_high="
                          f"{settings.accuracy_high} must satisfy 0 <= low <= high <= 1")
    if settings.step_value == "sum" and cfg.process_reward.step_reward != "score":
        raise ConfigError(
            f"process_reward.step_reward={cfg.process_reward.step_reward} treats step scores as probabilities, and "
            "implicit_prm.step_value=sum gives sums of log-ratios: set process_reward.step_reward=score, or "
            "implicit_prm.step_value=probability")


def validate_tree_rollout(cfg: GRPOConfig) -> None:
    """``process_reward.source=tree``: process supervision whose group is the tree's leaves (the branching's product
    is G), segments that leave the last level tokens to write, and no routing replay (a leaf's experts would come
    from several generate calls)."""
    tree, alg = cfg.tree_rollout, cfg.algorithm
    if not tree.branching or any(children < 1 for children in tree.branching):
        raise ConfigError(f"tree_rollout.branching={list(tree.branching)} must be a non-empty list of counts >= 1")
    if tree.segment_tokens < 1:
        raise ConfigError(f"tree_rollout.segment_tokens={tree.segment_tokens} must be >= 1")
    if cfg.process_reward.source != "tree":
        return
    if alg.supervision != "process":
        raise ConfigError("process_reward.source=tree needs algorithm.supervision=process")
    leaves = math.prod(tree.branching)
    if leaves != alg.num_return_sequences_in_group:
        raise ConfigError(
            f"tree_rollout.branching={list(tree.branching)} has {leaves} leaves but "
            f"algorithm.num_return_sequences_in_group={alg.num_return_sequences_in_group}: a tree's group is its "
            f"leaves; set algorithm.num_return_sequences_in_group={leaves} or change the branching")
    branch_tokens = (len(tree.branching) - 1) * tree.segment_tokens
    if cfg.process_reward.steps != "turns" and branch_tokens >= alg.response_length:  # by turns: no token segments
        raise ConfigError(
            f"tree_rollout.segment_tokens={tree.segment_tokens} x {len(tree.branching) - 1} branch levels = "
            f"{branch_tokens} tokens leaves none of algorithm.response_length={alg.response_length} to the last "
            "level: use fewer levels or shorter segments")
    if cfg.rollout.routing_replay:
        raise ConfigError("process_reward.source=tree samples a completion in several generate calls, whose routed "
                          "experts are not joined: set rollout.routing_replay=false")


def validate_multi_turn(cfg: GRPOConfig) -> None:
    """``rollout.multi_turn``: its ranges, and what cannot run with it yet (each refused with the reason; process
    supervision by turns: ``turn_checks``)."""
    mt = cfg.rollout.multi_turn
    check_choice(mt.format, ("hermes", "code"), "rollout.multi_turn.format")
    check_choice(mt.tool_response_truncate_side, ("left", "right", "middle"),
                 "rollout.multi_turn.tool_response_truncate_side")
    for key in ("max_turns", "max_tool_response_tokens"):
        if getattr(mt, key) < 1:
            raise ConfigError(f"rollout.multi_turn.{key}={getattr(mt, key)} must be >= 1")
    if mt.max_tokens_per_turn < 0:
        raise ConfigError(f"rollout.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn} must be >= 0 (0: the "
                          "response budget)")
    if not mt.sandbox.timeout_s > 0 or mt.sandbox.workers < 1:
        raise ConfigError("rollout.multi_turn.sandbox.timeout_s must be > 0 and rollout.multi_turn.sandbox.workers "
                          ">= 1")
    if not mt.enable:
        return
    if not mt.tools:
        raise ConfigError("rollout.multi_turn.enable=true needs rollout.multi_turn.tools (e.g. [calculator] or "
                          "[python]): a policy with no tool to call has a single turn")
    if mt.format == "code" and "python" not in mt.tools:
        raise ConfigError("rollout.multi_turn.format=code runs ```python blocks on the python tool: add python to "
                          "rollout.multi_turn.tools")
    if cfg.rollout.routing_replay:
        raise ConfigError("rollout.multi_turn.enable=true with rollout.routing_replay: a multi-turn response is "
                          "generated over several calls whose routed experts are not joined; turn one of them off")


def _speaks() -> bool:
    """Whether this process prints the config's warnings: the command's own process or rank 0 of a job."""
    import os

    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def validate_reward_functions(cfg: GRPOConfig) -> None:
    """``reward.function`` (or ``reward.functions`` with ``reward.weights``; ``reward.format_function`` when
    weighted) name a known reward; with process supervision from the reward function
    (``process_reward.source=function``), one function that returns step rewards (its return annotation: a
    ``float`` gives one score per completion, and so do verl's and TRL's signatures)."""
    from grpo_mega.reward.registry import REWARD_FUNCTIONS, reward_specs

    reward = cfg.reward
    if reward.functions and reward.function != type(reward)().function:  # a config's function, overridden
        if _speaks():
            logger.warning("ignoring reward.function=%s: reward.functions=%s replaces it", reward.function,
                           list(reward.functions))
        reward.function = type(reward)().function
    if reward.weights and not reward.functions:
        raise ConfigError(f"reward.weights={list(reward.weights)} weighs reward.functions, which is empty: list the "
                          "functions in reward.functions")
    try:
        specs = reward_specs(reward.function, reward.functions, reward.weights)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    key = "reward.functions" if reward.functions else "reward.function"
    named = [(key, spec) for spec, _ in specs]
    if reward.format_weight:
        named.append(("reward.format_function", reward.format_function))
    for key, spec in named:
        if ":" not in spec and spec not in REWARD_FUNCTIONS:
            raise ConfigError(f"{key}={spec!r} is no registered reward: use one of {sorted(REWARD_FUNCTIONS)}, "
                              "'package.module:function' or 'path/to/file.py:function'")
    if cfg.algorithm.supervision != "process" or cfg.process_reward.source != "function":
        return
    if reward.functions:
        raise ConfigError("algorithm.supervision=process with process_reward.source=function takes its step rewards "
                          "from one reward.function returning StepRewards; reward.functions sums scores: set "
                          "process_reward.source=prm (or tree, implicit), where reward.functions gives the outcome")
    from grpo_mega.reward.registry import get_reward_function

    try:
        function = get_reward_function(reward.function)
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"reward.function: {error}") from None
    returns = getattr(function, "__annotations__", {}).get("return")
    adapted = getattr(function, "signature_kind", None)
    if adapted is not None or getattr(returns, "__name__", returns) in ("float", "int", "bool"):
        what = f"{adapted}'s signature returns a score" if adapted is not None else str(returns)
        raise ConfigError(
            f"algorithm.supervision=process with process_reward.source=function takes its step rewards from "
            f"reward.function, but reward.function={reward.function!r} returns one score per completion "
            f"({what}): set reward.function=synthetic_steps (the synthetic task's step checker) or a function "
            "returning StepRewards, or process_reward.source=prm with process_reward.prm=PATH, or "
            "algorithm.supervision=outcome")


def validate_prompt_fields(cfg: GRPOConfig) -> None:
    """``data.format`` / ``data.eval_format`` are known formats; ``data.messages_field`` (conversation rows) is not
    read with the chat template turned off."""
    # not check_choice: tools/config_reference.py would list these values under the PRM config's data.format too
    for key in ("format", "eval_format"):
        value = getattr(cfg.data, key)
        if value is not None and value not in DATA_FORMATS:
            raise ConfigError(f"data.{key}={value!r}: expected one of {DATA_FORMATS}")
    if cfg.data.messages_field is not None and cfg.data.chat_template is False:
        raise ConfigError(f"data.messages_field={cfg.data.messages_field!r} holds conversations, which only a chat "
                          "template can render: set data.chat_template=true (or data.messages_field=null for "
                          "prompt rows)")


def validate_rollout_layout(cfg: GRPOConfig, world_size: int) -> None:
    """Resolve ``rollout.tensor_parallel: null`` to ``parallel.tensor``; with the vllm engine check that it divides
    ``world_size`` (torchrun's ``WORLD_SIZE``; 0 = not known yet, outside a launcher)."""
    rollout, derived = cfg.rollout, cfg.rollout.tensor_parallel is None
    if derived:
        rollout.tensor_parallel = cfg.parallel.tensor
    source = (f"rollout.tensor_parallel (unset, so parallel.tensor={rollout.tensor_parallel})" if derived
              else f"rollout.tensor_parallel={rollout.tensor_parallel}")
    if rollout.tensor_parallel < 1:
        raise ConfigError(f"{source} must be >= 1")
    if rollout.engine == "vllm" and world_size and rollout.mode != "async" and world_size % rollout.tensor_parallel:
        raise ConfigError(
            f"{source} does not divide the job's {world_size} processes: each vLLM rollout replica takes "
            f"rollout.tensor_parallel consecutive ranks. Set rollout.tensor_parallel to a divisor of {world_size} "
            f"(1 puts a whole copy of the model on every GPU), or run a multiple of it"
        )


def validate_rollout_mode(cfg: GRPOConfig, world_size: int) -> None:
    """``rollout.mode`` and, for ``async``, its ranks and staleness (``world_size``: the whole job's; 0 = not known
    yet, outside a launcher)."""
    rollout = cfg.rollout
    check_choice(rollout.mode, ("colocated", "async"), "rollout.mode")
    if rollout.mode != "async":
        return
    if rollout.async_ranks < 1:
        raise ConfigError(f"rollout.async_ranks={rollout.async_ranks} must be >= 1 (processes that generate)")
    if rollout.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness={rollout.max_staleness} must be >= 0")
    if rollout.max_staleness >= 1 and cfg.algorithm.rollout_is != "tis":
        raise ConfigError(
            f"rollout.max_staleness={rollout.max_staleness} trains on samples from weights up to that many updates "
            "old: set algorithm.rollout_is=tis (truncated importance sampling from the rollout engine's log-probs), "
            "or rollout.max_staleness=0")
    if cfg.parallel.offload_during_rollout:
        raise ConfigError("parallel.offload_during_rollout frees the training ranks' memory for a colocated rollout "
                          "engine; with rollout.mode=async the engine has ranks of its own: set it to false")
    if rollout.engine == "vllm" and rollout.async_ranks % rollout.tensor_parallel:
        raise ConfigError(f"rollout.async_ranks={rollout.async_ranks} is not a multiple of rollout.tensor_parallel="
                          f"{rollout.tensor_parallel}: each vLLM replica takes that many rollout ranks")
    if world_size:
        train_ranks = world_size - rollout.async_ranks
        if train_ranks < 1:
            raise ConfigError(f"rollout.async_ranks={rollout.async_ranks} leaves no training rank in a job of "
                              f"{world_size} processes: start more processes (e.g. --nproc {rollout.async_ranks + 1})")
        if train_ranks % (cfg.parallel.tensor * cfg.parallel.pipeline):
            raise ConfigError(
                f"the {train_ranks} training ranks (the job's {world_size} processes less rollout.async_ranks="
                f"{rollout.async_ranks}) are not a multiple of parallel.tensor x parallel.pipeline = "
                f"{cfg.parallel.tensor * cfg.parallel.pipeline}")


def validate_sft(cfg: SFTConfig, world_size: int | None = None) -> None:
    """Cross-field checks of an SFT config (``world_size`` as for :func:`validate`)."""
    validate_engine(cfg)
    validate_optim(cfg.optim)
    validate_trainer_common(cfg.trainer)
    validate_parallel(cfg.parallel)
    validate_world_size(cfg.parallel, launched_world_size() if world_size is None else world_size)
    check_choice(cfg.data.on_bad_row, ("skip", "error"), "data.on_bad_row")
    if cfg.data.messages_field is not None and not cfg.data.chat_template:
        raise ConfigError(f"data.messages_field={cfg.data.messages_field!r} holds conversations, which only a chat "
                          "template can render: set data.chat_template=true (or data.messages_field=null for "
                          "prompt/response rows)")
    if cfg.data.segments_field is not None and (cfg.data.chat_template or cfg.data.messages_field is not None):
        raise ConfigError(f"data.segments_field={cfg.data.segments_field!r} holds tool-use responses in the fallback "
                          "format (no chat template): set data.chat_template=false and data.messages_field=null")
    validate_experts(cfg.model, cfg.parallel)
    check_context_length(cfg.model, cfg.data.max_length, "data.max_length")
    for key in ("total_steps", "batch_size"):
        if getattr(cfg.trainer, key) < 1:
            raise ConfigError(f"trainer.{key} must be >= 1")


def validate_routing_replay(cfg: GRPOConfig) -> None:
    """``rollout.routing_replay``: megatron's router replay on the policy of a mixture-of-experts model, whose
    forward passes each run once (``parallel.recompute=full`` re-runs the routers in the backward pass)."""
    if not cfg.rollout.routing_replay:
        return
    if cfg.engine != "megatron":
        raise ConfigError(f"rollout.routing_replay=true replays routes through megatron-core's router; "
                          f"engine={cfg.engine} has none: set engine=megatron or rollout.routing_replay=false")
    if cfg.parallel.recompute == "full":
        raise ConfigError("rollout.routing_replay=true with parallel.recompute=full: the recomputed forward in the "
                          "backward pass would route on its own; set parallel.recompute=selective (core attention "
                          "only) or none")
    config_file, hf = model_config_json(cfg.model)
    if hf is not None and not num_experts(hf):
        raise ConfigError(f"rollout.routing_replay=true is for mixture-of-experts models, and {config_file} is a "
                          f"{hf.get('model_type')!r} model without experts: set rollout.routing_replay=false")


def validate_answer_guard(cfg: GRPOConfig) -> None:
    """``process_reward.answer_pattern`` compiles and ``missing_answer_score`` is finite (the answer guard's)."""
    settings = cfg.process_reward
    if settings.answer_pattern is not None:
        try:
            re.compile(settings.answer_pattern)
        except re.error as error:
            raise ConfigError(f"process_reward.answer_pattern={settings.answer_pattern!r} is not a valid regular "
                              f"expression: {error}") from None
    if not math.isfinite(settings.missing_answer_score):
        raise ConfigError(f"process_reward.missing_answer_score={settings.missing_answer_score} must be finite")


def validate_prm_scorer(settings) -> None:
    """``process_reward.scorer`` and its vLLM sizes (``prm.vllm_scoring``)."""
    check_choice(settings.scorer, ("engine", "vllm"), "process_reward.scorer")
    if settings.vllm_tensor_parallel < 1:
        raise ConfigError(f"process_reward.vllm_tensor_parallel={settings.vllm_tensor_parallel} must be >= 1")
    if not 0.0 < settings.vllm_gpu_memory_utilization <= 1.0:
        raise ConfigError(f"process_reward.vllm_gpu_memory_utilization={settings.vllm_gpu_memory_utilization} "
                          "must be in (0, 1]")
    if settings.scorer == "vllm" and settings.source != "prm":
        raise ConfigError(f"process_reward.scorer=vllm runs a PRM: it needs process_reward.source=prm "
                          f"(source is {settings.source!r})")
