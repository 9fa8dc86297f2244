"""The HF ``architectures`` names of a classifier PRM, without torch: the checks a command makes before it imports
torch (``prm score / eval --prm``: which layout a folder's config.json names) read them here;
``grpo_mega.checkpoint.hf_layouts`` builds the classifier's conversion tables on them."""

from __future__ import annotations

from collections.abc import Sequence

PRM_CLASSIFIER_ARCHITECTURE = "Qwen2ForProcessRewardModel"
"""Qwen2.5-Math-PRM's architecture name."""
PRM_CLASSIFIER_ARCHITECTURES: dict[str, str] = {"qwen2": PRM_CLASSIFIER_ARCHITECTURE,
                                                "qwen3": "Qwen3ForProcessRewardModel"}
"""model_type -> the `architectures` name of a classifier PRM on that backbone. Qwen published the Qwen2 one
(Qwen2.5-Math-PRM); a Qwen3 backbone with the same step classifier is named the same way."""


def is_prm_classifier(architectures: Sequence[str] | None) -> bool:
    """Whether a config's `architectures` names a classifier PRM (`PRM_CLASSIFIER_ARCHITECTURES`)."""
    return any(name in PRM_CLASSIFIER_ARCHITECTURES.values() for name in architectures or ())
