"""Opening a PRM: its weights into a PRM engine (``prm.engines``), as a finished PRM to score with or as the start
of PRM training.

``open_prm`` opens a finished PRM for scoring, from an HF PRM folder of either layout, a converted megatron folder,
or a grpo-mega PRM checkpoint (its spec from ``prm.spec.trained_spec``); ``load_prm_init_weights`` starts a PRM
from a policy (for ``classifier`` the backbone only; the policy's LM head is dropped and the classifier head keeps
its initialisation). Either path is resolved once (``grpo_mega.checkpoint.source``) and the engine loads it through
its own ``load_model_source``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from grpo_mega.checkpoint.hf_layouts import architecture_for
from grpo_mega.checkpoint.source import ModelSource, resolve_model_source
from prm.engines import build_prm_forward_engine
from prm.spec import PRMSpec, config_field, spec_with_overrides, trained_spec

logger = logging.getLogger(__name__)

# Sizes a policy must share with a PRM for its backbone to be loaded into it.
_BACKBONE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size")


# --------------------------------------------------------------------------------------------- starting from a policy
def _check_backbone_fits(source_config: Any, prm_config: Any, source: Any) -> None:
    """ValueError listing the backbone sizes in which the source model differs from the PRM."""
    differ = [
        f"{name} {config_field(source_config, name)!r} vs {config_field(prm_config, name)!r}"
        for name in _BACKBONE_FIELDS
        if config_field(source_config, name) != config_field(prm_config, name)
    ]
    if differ:
        raise ValueError(f"{source}: its model does not fit the PRM's backbone (source vs PRM): " + "; ".join(differ))


def load_prm_init_weights(engine, source: str | os.PathLike | ModelSource | None) -> str:
    """Start a PRM engine from a policy's weights: anything ``load_initial_weights`` accepts (HF folder, converted
    megatron folder, grpo-mega training checkpoint or run directory); collective. Returns the format loaded.

    ``lm_tokens``: exactly ``load_initial_weights`` (the PRM is the policy's model). ``classifier``: the backbone
    is loaded, the policy's LM head (lm_head / output layer) is not read, and the classifier head keeps its
    initialisation; a source that is itself a classifier PRM gives its head too. Which of these happened is
    logged. Raises ValueError naming the source and the sizes when its model does not fit the PRM's backbone.
    """
    from grpo_mega.checkpoint.initial_weights import load_initial_weights

    if source is None:
        return load_initial_weights(engine, None)
    model = resolve_model_source(source)
    if model.hf_config is not None:
        _check_backbone_fits(model.hf_config, engine.hf_config, source)
    if architecture_for(engine.hf_config).lm_output:
        return load_initial_weights(engine, model)
    with_head = model.hf_config is not None and not architecture_for(model.hf_config).lm_output
    if with_head:
        engine.load_model_source(model)
    elif getattr(engine, "engine_name", "megatron") == "deepspeed":
        from prm.hf_model import load_backbone_weights

        load_backbone_weights(engine, model)
    else:
        engine.load_model_source(model, backbone_only=True)
    logger.info(
        "classifier PRM initialised from %s (%s): backbone loaded, %s", source, model.kind,
        "classifier head loaded too (the source is a classifier PRM)" if with_head else
        "the source's LM head ignored, the classifier head keeps its random initialisation",
    )
    return model.kind


# --------------------------------------------------------------------------------------------- opening a PRM
@dataclass
class LoadedPRM:
    """A PRM ready to score: its forward-only engine, how it reads solutions, its tokenizer and HF config."""

    engine: Any
    """A forward-only engine (Megatron or DeepSpeed) with outputs ``good_logprob`` / ``bad_logprob``."""
    spec: PRMSpec
    tokenizer: Any
    hf_config: Any
    source: ModelSource
    """Where it was opened from, with the settings it was trained with (``prm.spec.PRMChoices.render_settings``)."""


def load_prm_tokenizer(folder: str | os.PathLike, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{what}: no tokenizer could be loaded from {folder} ({error})") from None


def open_prm(
    path: str | os.PathLike | ModelSource,
    *,
    spec_overrides: dict | None = None,
    max_tokens_per_micro_batch: int = 4096,
    engine_kind: str = "megatron",
    deepspeed=None,
    share_prompt_prefix: bool = True,
) -> LoadedPRM:
    """A forward-only PRM from ``path``; collective, after ``grpo_mega.parallel.init_distributed`` (any TP/PP/DP;
    ``engine_kind="deepspeed"``: TP = PP = 1, a DeepSpeed forward engine with ``deepspeed``, any of the formats).

    ``path`` is an HF PRM folder of either layout (layout from its config.json, spec = ``default_spec`` of it), a
    converted megatron folder of one (``tools/convert_hf_to_mcore.py``), or a grpo-mega PRM training checkpoint /
    run directory (HF config, tokenizer and spec from its saved config: ``model.hf_config``, ``model.tokenizer``,
    ``prm``), or with ``spec_overrides={"layout": "likelihood", ...}`` a policy's training checkpoint.
    ``spec_overrides`` replaces spec fields (e.g. ``{"step_tag": "\\n\\n"}``; ``prm.spec.spec_with_overrides``).
    ``share_prompt_prefix`` (Megatron): rows that share a prompt carry one copy of it through the layers
    (``prm.engines.build_prm_forward_engine``).
    Raises ValueError for an unknown override, a layout the config contradicts, or a folder that is none of these.
    """
    try:
        source = resolve_model_source(path)
    except ValueError as error:  # the resolver speaks of init_from; here the path is a PRM
        raise ValueError(f"PRM {path}: {str(error).removeprefix('init_from: ')}") from None
    overrides = dict(spec_overrides or {})
    if source.hf_config is None:
        hf_dir = source.model_settings.get("hf_config")
        raise ValueError(f"{path}: the checkpoint's config model.hf_config ({hf_dir!r}) has no config.json")
    spec = spec_with_overrides(trained_spec(source, overrides.get("layout")), overrides)
    what = f"{path}: model.tokenizer" if source.is_checkpoint else str(path)
    tokenizer = load_prm_tokenizer(source.tokenizer_folder, what)
    engine = build_prm_forward_engine(source.hf_config, spec, tokenizer,
                                      max_tokens_per_micro_batch=max_tokens_per_micro_batch, engine_kind=engine_kind,
                                      deepspeed=deepspeed, share_prompt_prefix=share_prompt_prefix)
    engine.load_model_source(source)
    return LoadedPRM(engine=engine, spec=spec, tokenizer=tokenizer, hf_config=source.hf_config, source=source)
