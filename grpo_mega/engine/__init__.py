"""Training engines behind one interface (:class:`TrainingEngine`): Megatron-core today."""

from grpo_mega.engine.base import LossFn, LossScale, TrainingEngine
from grpo_mega.engine.factory import build_engine, build_policy_engine
from grpo_mega.engine.megatron_engine import MegatronEngine

__all__ = ["LossFn", "LossScale", "MegatronEngine", "TrainingEngine", "build_engine", "build_policy_engine"]
