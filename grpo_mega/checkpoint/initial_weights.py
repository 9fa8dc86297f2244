"""The weights a run starts from (``model.init_from``), loaded into any engine through its interface.

One entry point for the policy, the KL reference (a forward-only engine) and an ``lm_tokens`` PRM: a Hugging Face
folder, a converted megatron model folder, a grpo-mega training checkpoint or a run directory (its newest complete
checkpoint), each at the job's TP / PP, with the bf16 master copies of a training engine following the weights.
The path is resolved once (``grpo_mega.checkpoint.source``) and the engine loads it (``engine.load_model_source``).
A classifier PRM started from a policy (whose LM head it does not have) goes through
``prm.model.load_prm_init_weights``, which loads the backbone only.
"""

from __future__ import annotations

import logging
import os

from grpo_mega.checkpoint.source import ModelSource, resolve_model_source

logger = logging.getLogger(__name__)


def load_initial_weights(engine, source: str | os.PathLike | ModelSource | None) -> str:
    """Load ``source`` into ``engine`` (a training or forward-only engine); collective. Returns the format
    loaded: ``hf``, ``mcore_model``, ``training_checkpoint``, ``training_run``, or ``random`` for None.

    None leaves the engine's random initialisation (with a warning). Raises ValueError naming the folder when it
    is none of the known formats (``grpo_mega.checkpoint.source.resolve_model_source``) or does not fit the
    model (shapes, vocabulary, missing tensors).
    """
    if source is None:
        logger.warning("model.init_from is not set: the model starts from random weights")
        return "random"
    source = resolve_model_source(source)
    engine.load_model_source(source)
    return source.kind
