"""Process groups, device selection and the CPU (gloo) compatibility layer for megatron-core.

It may import torch and megatron-core, nothing else of grpo_mega; everything that runs in a rank imports it.
"""

from grpo_mega.parallel.cpu_compat import apply_cpu_compat
from grpo_mega.parallel.distributed import (
    destroy_distributed,
    destroy_model_parallel,
    get_device,
    init_distributed,
    init_model_parallel,
    resolve_device,
    seed_everything,
)
from grpo_mega.parallel.launch_env import LaunchEnv, read_launch_env
from grpo_mega.parallel.layout import (
    ParallelLayout,
    layout_for_world,
    validate_layout,
    validate_model_split,
)

__all__ = [
    "LaunchEnv",
    "ParallelLayout",
    "apply_cpu_compat",
    "destroy_distributed",
    "destroy_model_parallel",
    "get_device",
    "init_distributed",
    "init_model_parallel",
    "layout_for_world",
    "read_launch_env",
    "resolve_device",
    "seed_everything",
    "validate_layout",
    "validate_model_split",
]
