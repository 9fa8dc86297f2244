"""What generating needs, built from a GRPO config: the prompt records, the rollout engine, the PRM step-reward
source, the evaluation. Shared by the trainer (colocated mode) and the rollout world (``rollout.mode: async``,
``grpo_mega.rollout_worker``), so both build the same thing from the same config."""

from __future__ import annotations

import atexit
import dataclasses
import logging

from grpo_mega.config import GRPOConfig, validate_rollout_layout, validate_rollout_mode
from grpo_mega.config.loading import ConfigError
from grpo_mega.data.formats import field_settings
from grpo_mega.data.prompts import load_prompt_dataset
from grpo_mega.parallel import destroy_model_parallel, get_device, read_launch_env
from grpo_mega.reward.adapters import RewardRows, reward_rows_of
from grpo_mega.reward.registry import build_reward_function
from grpo_mega.rollout import build_rollout_engine
from grpo_mega.rollout.base import load_hf_tokenizer
from grpo_mega.rollout.engine_choice import (EngineChoice, choose_rollout_engine, parameters_from_hf_config,
                                             vllm_installed)
from grpo_mega.stages.answer_guard import answer_guard_of
from grpo_mega.stages.evaluation import evaluate

logger = logging.getLogger(__name__)


def refuse_hf_settings_under_vllm(choice: EngineChoice, *, decode_graphs: str) -> None:
    """A ConfigError when ``auto`` chose vllm but the config sets a key only the hf engine reads: the load-time check
    (``rollout.decode_graphs`` with ``rollout.engine: vllm``) could not know the engine yet, and the setting would
    be dropped without a word. Refused, not warned, like the vllm layout checks re-run for the same choice."""
    if choice.engine == "vllm" and decode_graphs != "off":
        raise ConfigError(f"rollout.decode_graphs={decode_graphs} applies to the hf engine, but rollout.engine=auto "
                          f"chose vllm ({choice.reason}), which captures its own CUDA graphs: set rollout.engine=hf "
                          f"to decode with it, or rollout.decode_graphs=off")


def settle_rollout_engine(cfg: GRPOConfig) -> EngineChoice | None:
    """Replace ``rollout.engine: auto`` in ``cfg`` by the engine this rank's device runs fastest
    (``grpo_mega.rollout.engine_choice``), check the vllm layout again for it and refuse hf-only settings under
    vllm (the load-time checks could not know the device), and log the choice with its reason; None when the config
    names its engine. Every rank of a job decides alike (same device type, same installation). Call before the
    job's processes split into roles."""
    if cfg.rollout.engine != "auto":
        return None
    from transformers import AutoConfig

    launch = read_launch_env()  # torchrun's or srun's rank and world size (1 for a lone process)
    parameters = parameters_from_hf_config(AutoConfig.from_pretrained(cfg.model.hf_config).to_dict())
    choice = choose_rollout_engine("auto", device_type=get_device(cfg.parallel.device).type,
                                   has_vllm=vllm_installed(), parameters=parameters)
    refuse_hf_settings_under_vllm(choice, decode_graphs=cfg.rollout.decode_graphs)
    cfg.rollout.engine = choice.engine
    validate_rollout_layout(cfg, launch.world_size)
    validate_rollout_mode(cfg, launch.world_size)
    if launch.rank == 0:
        logger.info("rollout engine: %s (%s)", choice.engine, choice.reason)
    return choice


def load_prompts(cfg: GRPOConfig, tokenizer, path: str, *, eval_file: bool = False):
    """The usable prompt records of ``path`` (``data.*``; ``eval_file``: read with ``data.eval_format``). With
    ``rollout.multi_turn`` in the hermes format, a chat template is given the tools' schemas (``tools=``), so the
    prompt tells the policy what it may call the way its template does."""
    data = cfg.data
    mt = cfg.rollout.multi_turn
    tools = None
    if mt.enable and mt.format == "hermes":
        from grpo_mega.tools import tool_schemas

        tools = tool_schemas(list(mt.tools))
    return load_prompt_dataset(
        path, tokenizer, prompt_length=data.prompt_length, prompt_field=data.prompt_field,
        answer_field=data.answer_field, on_bad_row=data.on_bad_row, use_chat_template=data.chat_template,
        messages_field=data.messages_field, format=field_settings(data, eval_file=eval_file).format, tools=tools,
    ).records


_TOOLSETS: dict[int, object] = {}


def toolset_for(cfg: GRPOConfig):
    """The tools of ``rollout.multi_turn`` (``grpo_mega.tools.build_toolset``: its pool of sandbox workers), built
    once per process and config, by the process that runs the turn loop (a process that only renders prompts reads
    the schemas alone, ``tool_schemas``: async mode's training ranks start no sandbox worker); closed with the
    rollout engine (``TurnLoopEngine.close``), and at the latest when the process exits."""
    if id(cfg) not in _TOOLSETS:
        from grpo_mega.tools import SandboxConfig, build_toolset

        mt = cfg.rollout.multi_turn
        toolset = build_toolset(list(mt.tools), SandboxConfig(**dataclasses.asdict(mt.sandbox)))
        atexit.register(_close_quietly, toolset)
        _TOOLSETS[id(cfg)] = toolset
    return _TOOLSETS[id(cfg)]


def _close_quietly(toolset) -> None:
    try:
        toolset.close()
    except Exception:  # already closed with its engine, or the process is going down anyway
        pass


def with_turn_loop(cfg: GRPOConfig, engine, tokenizer):
    """``engine`` itself, or with ``rollout.multi_turn.enable`` the turn loop around it
    (``grpo_mega.rollout.turn_loop``)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return engine
    from grpo_mega.rollout.tool_turns import tool_turns_for
    from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings

    settings = TurnLoopSettings(
        max_response_tokens=cfg.algorithm.response_length, max_turns=mt.max_turns,
        max_tokens_per_turn=mt.max_tokens_per_turn or None, max_tool_response_tokens=mt.max_tool_response_tokens,
        tool_response_truncate_side=mt.tool_response_truncate_side, format=mt.format)
    tool_turns = tool_turns_for(mt.format, tokenizer, use_chat_template=cfg.data.chat_template)
    return TurnLoopEngine(engine, toolset_for(cfg), tokenizer, settings, tool_turns)


def eval_prompts(cfg: GRPOConfig, tokenizer) -> list:
    """The held-out prompts (``data.eval_file``, at most ``data.max_eval_prompts``); none without an eval file."""
    if not cfg.data.eval_file:
        return []
    return load_prompts(cfg, tokenizer, cfg.data.eval_file, eval_file=True)[: cfg.data.max_eval_prompts]


def step_reward_source(cfg: GRPOConfig, decode):
    """The step-reward source of ``process_reward.source`` (``grpo_mega.stages.step_sources``): the PRM on its own
    forward-only engine, the tree sampler; None where the reward function (or the trainer's implicit PRM) gives the
    step rewards. ``decode``: response token ids -> the completion's text."""
    from grpo_mega.stages.step_sources import build_step_reward_source

    return build_step_reward_source(cfg, decode)


def build_rollout_engine_for(cfg: GRPOConfig, tokenizer):
    """The rollout engine on this rank's device (``parallel.device``): bf16 on a GPU, fp32 on the CPU. vllm: one
    engine per rank inside torchrun (external_launcher), ``rollout.tensor_parallel`` ranks per replica, eager on
    the CPU."""
    device = get_device()
    engine = build_rollout_engine(cfg.rollout.engine, model_path=cfg.model.hf_config, tokenizer=tokenizer,
                                  dtype="bfloat16" if device.type == "cuda" else "float32",
                                  **rollout_engine_settings(cfg, device))
    return with_turn_loop(cfg, engine, load_hf_tokenizer(tokenizer))


def rollout_engine_settings(cfg: GRPOConfig, device) -> dict:
    """The keyword arguments of ``rollout.engine``'s engine on ``device``, from the config."""
    engine_settings = (
        {"generation_batch_size": cfg.rollout.generation_batch_size, "device": device,
         "decode_graphs": cfg.rollout.decode_graphs} if cfg.rollout.engine == "hf"
        else {"gpu_memory_utilization": cfg.rollout.gpu_memory_utilization, "seed": cfg.parallel.seed,
              "tensor_parallel_size": cfg.rollout.tensor_parallel,
              "enforce_eager": cfg.rollout.enforce_eager or device.type == "cpu",
              "max_num_seqs": cfg.rollout.max_num_seqs, "max_num_batched_tokens": cfg.rollout.max_num_batched_tokens,
              "max_model_len": cfg.data.prompt_length + cfg.algorithm.response_length}
    )
    if cfg.rollout.routing_replay:  # the experts of every token, replayed by the trainer
        engine_settings["return_routed_experts"] = True
    return engine_settings


def row_layout_of(cfg: GRPOConfig) -> RewardRows:
    """What a TRL reward function needs to know of the rows: the answer column's name and whether the prompts are
    conversations, as the train file's layout says (``data.format``; ``auto``: from its first row)."""
    return reward_rows_of(cfg.data)


def reward_function_of(cfg: GRPOConfig):
    """The run's verifier: ``reward.function``, or the weighted sum of ``reward.functions``."""
    return build_reward_function(cfg.reward.function, cfg.reward.functions, cfg.reward.weights, row_layout_of(cfg))


def run_evaluation(cfg: GRPOConfig, rollout_engine, prompts, version: int, *,
                   on_completions=None) -> dict[str, float]:
    """The held-out evaluation of the weights after step ``version`` (collective; {} without eval prompts);
    ``on_completions``: more metrics of the evaluated completions (``grpo_mega.stages.evaluation.evaluate``)."""
    if not prompts:
        return {}
    try:
        return evaluate(rollout_engine, prompts, reward_function_of(cfg),
                        max_new_tokens=cfg.algorithm.response_length, stop=cfg.rollout.stop,
                        temperature=cfg.trainer.eval_temperature, seed=cfg.parallel.seed + version,
                        on_error=cfg.reward.on_error, on_completions=on_completions)
    finally:  # multi-turn: the evaluation's tool seconds are not the next training step's
        getattr(rollout_engine, "pop_tool_seconds", float)()


def close_rollout_engine(rollout_engine, stage=None) -> None:
    """Shut down a rollout engine that holds process groups (vllm), and the vLLM PRM scorer of ``stage``'s step
    reward source (``process_reward.scorer: vllm``), after megatron's groups: inside torchrun vLLM's shutdown also
    destroys the default process group. A scorer left to the interpreter's exit shut down after the job's groups
    were gone and ended every rank with a traceback (``Invalid process group specified``)."""
    scorer = getattr(getattr(stage, "step_reward_source", None), "scorer", None)
    closers = [close for close in (getattr(scorer, "close", None), getattr(rollout_engine, "close", None)) if close]
    if closers:
        destroy_model_parallel()
    for close in closers:
        close()
