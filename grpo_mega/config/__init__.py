"""Run configuration: dataclasses with a docstring per field, loaded from YAML with ``key=value`` overrides.

- ``sections``: what every run shares (model, parallel layout, optimizer, DeepSpeed, the run settings of ``trainer``);
- ``grpo`` and ``sft``: the GRPO and SFT configs built on them (the PRM's is ``prm.config``);
- ``loading``: ``load_config`` / ``save_config``; OmegaConf validates against the dataclasses, so an unknown key or a
  value of the wrong type fails at start-up with the key named;
- ``checks``: checks of the shared sections; ``cross_field``: the checks that span a whole config (:func:`validate`,
  :func:`validate_sft`);
- ``preflight``: what a command checks in its own process before it starts any rank (the config against the job's
  process count, the paths it names, the run folder).

It may import ``algo`` (the names of the GRPO options), ``run`` (the run folder guard), ``reward`` (which reward
functions exist and what they return) and the PRM's spec (``prm.examples``, ``prm.rendering``,
``prm.spec``: which layout a PRM path holds); the harness, the trainers, the PRM library and the commands import it.
"""

from grpo_mega.config.checks import (
    LOGGERS,
    check_choice,
    check_context_length,
    launched_world_size,
    validate_engine,
    validate_experts,
    validate_memory_settings,
    validate_optim,
    validate_parallel,
    validate_trainer_common,
    validate_world_size,
)
from grpo_mega.config.cross_field import validate, validate_rollout_layout, validate_rollout_mode, validate_sft
from grpo_mega.config.grpo import (
    PROCESS_REWARD_SOURCES,
    STEP_CREDITS,
    AlgorithmConfig,
    DataConfig,
    GRPOConfig,
    ImplicitPRMConfig,
    ProcessRewardConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from grpo_mega.config.loading import ConfigError, config_yaml, load_config, save_config
from grpo_mega.config.sections import (
    DEVICE_CHOICES,
    ENGINES,
    RECOMPUTE_CHOICES,
    DeepSpeedConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
)
from grpo_mega.config.sft import SFTConfig, SFTDataConfig, SFTTrainerConfig

__all__ = [
    "AlgorithmConfig", "ConfigError", "DEVICE_CHOICES", "DataConfig", "DeepSpeedConfig", "ENGINES", "GRPOConfig",
    "ImplicitPRMConfig", "LOGGERS", "ModelConfig", "OptimConfig", "PROCESS_REWARD_SOURCES", "ParallelConfig",
    "ProcessRewardConfig",
    "RECOMPUTE_CHOICES", "RewardConfig", "RolloutConfig", "RunConfig", "SFTConfig", "SFTDataConfig",
    "SFTTrainerConfig", "STEP_CREDITS", "TrainerConfig", "check_choice", "check_context_length", "config_yaml",
    "launched_world_size", "load_config",
    "save_config", "validate", "validate_engine", "validate_experts", "validate_memory_settings", "validate_optim", "validate_parallel",
    "validate_rollout_layout",
    "validate_rollout_mode", "validate_sft", "validate_trainer_common", "validate_world_size",
]
