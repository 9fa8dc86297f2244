"""``grpo-mega plan``: the memory plan of a GRPO config, per rank and per phase, before a GPU is asked for.

``plan_config(cfg, gpus_per_node=8, gpu_memory_gib=79.6)`` returns a :class:`Plan` (``plan.phases``: update,
generation, prm_scoring, each with its byte items; ``plan.fits``, ``plan.problems``); ``report`` prints it.
Modules: ``counts`` (parameters from megatron's model on the meta device), ``static`` (parameters, DDP gradient
buffers, optimizer state), ``activations``, ``vllm``, ``phases`` (what each phase holds, the verdict),
``report`` (table and JSON), ``measure`` (what an engine really allocates, for the checks). The step-time model
(``grpo-mega plan --steps``): ``step_time`` (seconds per phase from FLOPs and bytes), ``devices`` (device
profiles), ``timing`` (a config and its plan into those formulas).

It may import ``checkpoint``, ``config``, ``model``, ``parallel``, ``rollout`` (vLLM's settings) and the PRM library;
only the CLI imports it.
"""

from grpo_mega.plan.build import plan_config
from grpo_mega.plan.phases import Phase, Plan
from grpo_mega.plan.settings import Hardware, MemorySettings

__all__ = ["Hardware", "MemorySettings", "Phase", "Plan", "plan_config"]
