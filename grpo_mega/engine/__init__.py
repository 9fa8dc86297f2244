"""Training engines behind one interface (:class:`TrainingEngine`), and forward-only engines
(:class:`ForwardEngine`): Megatron-core today.

It may import ``model``, ``checkpoint`` and ``parallel``; the stages, the trainers, the PRM library and the planner
import it.
"""

from grpo_mega.engine.base import ForwardEngine, LossFn, LossScale, NonFiniteError, TrainingEngine
from grpo_mega.engine.factory import (
    build_engine,
    build_forward_engine,
    build_policy_engine,
    build_reference_engine,
)
from grpo_mega.engine.megatron_engine import MegatronEngine
from grpo_mega.engine.megatron_base import MegatronForwardEngine

__all__ = [
    "ForwardEngine",
    "LossFn",
    "LossScale",
    "MegatronEngine",
    "MegatronForwardEngine",
    "NonFiniteError",
    "TrainingEngine",
    "build_engine",
    "build_forward_engine",
    "build_policy_engine",
    "build_reference_engine",
]
