"""The PRM on the training engines: what a PRM is (``PRMSpec``), its engines, and where its weights come from.

Two published layouts, told apart by the HF config's ``architectures``, and a third on any causal LM
(``PRM_LAYOUTS``):

- ``classifier`` (Qwen2.5-Math-PRM): ``Qwen2ForProcessRewardModel``, a Qwen2 backbone without LM head and a step
  classifier ``score`` (:class:`~prm.heads.ClassifierHead`); steps end with the tag ``<extra_0>``.
- ``lm_tokens`` (Math-Shepherd): an ordinary causal LM scoring a step by its next-token odds of "+" against "-"
  (:class:`~prm.heads.LabelTokenHead`); steps end with the tag `` ки``.

- ``likelihood``: a causal LM (the policy itself, or one trained from it) scoring a step by its own probability of
  the step as written: the smallest p(token | text before it) over the step's tokens
  (:class:`~prm.heads.StepLikelihoodHead`); no tag (``step_tag=""``), chosen explicitly (``--layout likelihood``,
  ``prm.layout``), since its checkpoints are ordinary causal LMs.

In the first two, a step is scored at the last token of its step tag, from that token's own hidden state; the engines'
outputs are ``good_logprob`` / ``bad_logprob`` per token (score = ``exp(good_logprob)``). ``engine_kind`` chooses the
engine: ``megatron`` (a GPT backbone with the ``prm.heads`` head; TP / PP / DP) or ``deepspeed`` (the transformers
model of ``prm.hf_model`` under ZeRO; data parallel only).

Weights: ``load_prm_init_weights`` starts a PRM from a policy (for ``classifier`` the backbone only; the policy's
LM head is dropped and the classifier head keeps its initialisation); ``open_prm`` opens a finished PRM for
scoring, from an HF PRM folder of either layout, a converted megatron folder, or a grpo-mega PRM checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from grpo_mega.checkpoint.hf_layouts import PRM_CLASSIFIER_ARCHITECTURE, architecture_for
from prm.heads import OUTPUT_NAMES, ClassifierHead, LabelTokenHead, StepLikelihoodHead

logger = logging.getLogger(__name__)

PRM_LAYOUTS = ("classifier", "lm_tokens", "likelihood")
CLASSIFIER_STEP_TAG = "<extra_0>"
"""Qwen2.5-Math-PRM's step separator."""
LM_TOKENS_STEP_TAG = " ки"
"""Math-Shepherd's step tag."""
_CAUSAL_LM_BY_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# Sizes a policy must share with a PRM for its backbone to be loaded into it.
_BACKBONE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size")


@dataclass(frozen=True)
class PRMSpec:
    """How a PRM reads a solution: its head layout, the tag that ends every step, and (``lm_tokens``) the label
    tokens whose next-token odds make the step score."""

    layout: str
    """``classifier``, ``lm_tokens`` or ``likelihood`` (``PRM_LAYOUTS``)."""
    step_tag: str
    """Text appended after every step; the step is scored at the tag's last token. Empty for ``likelihood``."""
    good_token: str = "+"
    """``lm_tokens``: the label token of a good step (one token of the tokenizer)."""
    bad_token: str = "-"
    """``lm_tokens``: the label token of a bad step."""

    def __post_init__(self) -> None:
        if self.layout not in PRM_LAYOUTS:
            raise ValueError(f"prm.layout must be one of {PRM_LAYOUTS}, got {self.layout!r}")
        if self.layout == "likelihood" and self.step_tag != "":
            raise ValueError(f"prm.layout=likelihood scores the steps as the policy wrote them, without a tag: "
                             f"prm.step_tag must be \"\", got {self.step_tag!r}")
        tagged = ("step_tag",) if self.layout != "likelihood" else ()
        for name in (*tagged, "good_token", "bad_token"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"prm.{name} must be a non-empty string, got {value!r}")
        if self.good_token == self.bad_token:
            raise ValueError(f"prm.good_token and prm.bad_token must differ, both are {self.good_token!r}")

    def to_dict(self) -> dict[str, str]:
        """Plain dict of the fields (YAML / JSON friendly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "prm") -> PRMSpec:
        """The spec of a dict with the fields of ``to_dict`` (``where`` names it in errors); ValueError for an
        unknown or missing field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a mapping with layout and step_tag, got {type(data).__name__}")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
        missing = [name for name in ("layout", "step_tag") if data.get(name) is None]
        if data.get("layout") == "likelihood" and "step_tag" in missing:
            missing.remove("step_tag")  # it has no tag
            data = {**data, "step_tag": ""}
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        return cls(**{name: value for name, value in data.items() if value is not None})


def default_spec(layout: str) -> PRMSpec:
    """The published convention of ``layout``: classifier tag ``<extra_0>``; lm_tokens tag `` ки`` with "+"/"-";
    likelihood no tag."""
    if layout == "classifier":
        return PRMSpec("classifier", CLASSIFIER_STEP_TAG)
    if layout == "lm_tokens":
        return PRMSpec("lm_tokens", LM_TOKENS_STEP_TAG, "+", "-")
    if layout == "likelihood":
        return PRMSpec("likelihood", "")
    raise ValueError(f"PRM layout must be one of {PRM_LAYOUTS}, got {layout!r}")


def _config_field(hf_config: Any, name: str) -> Any:
    return hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(hf_config, name, None)


def detect_layout(hf_config: Any) -> str:
    """The PRM layout of an HF config (object or config.json dict), from its ``architectures``:
    Qwen2ForProcessRewardModel -> ``classifier``, a ``*ForCausalLM`` -> ``lm_tokens``; ValueError otherwise."""
    architectures = list(_config_field(hf_config, "architectures") or [])
    if PRM_CLASSIFIER_ARCHITECTURE in architectures:
        return "classifier"
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "lm_tokens"
    raise ValueError(
        f"cannot tell the PRM layout from the HF config's architectures {architectures}: expected "
        f"{PRM_CLASSIFIER_ARCHITECTURE} (classifier) or a *ForCausalLM (lm_tokens)"
    )


def config_layout(hf_config: Any) -> str:
    """``detect_layout``, with a config that names no architectures taken as a causal LM's (``lm_tokens``):
    transformers writes a bare ``Qwen2Config`` that way."""
    return detect_layout(hf_config) if _config_field(hf_config, "architectures") else "lm_tokens"


def label_token_ids(tokenizer: Any, spec: PRMSpec) -> tuple[int, int]:
    """Ids of ``spec.good_token`` and ``spec.bad_token``. Each must encode (``add_special_tokens=False``) to
    exactly one token that is not the unknown token; ValueError naming the token and what it encodes to."""
    ids = []
    for field in ("good_token", "bad_token"):
        token = getattr(spec, field)
        encoded = list(tokenizer.encode(token, add_special_tokens=False))
        if len(encoded) != 1:
            raise ValueError(
                f"prm.{field} {token!r} must be exactly one token, but the tokenizer encodes it to {len(encoded)} "
                f"tokens: ids {encoded} = {tokenizer.convert_ids_to_tokens(encoded)}"
            )
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and encoded[0] == unk and token != tokenizer.unk_token:
            raise ValueError(
                f"prm.{field} {token!r} is not in the tokenizer's vocabulary: it encodes to the unknown token "
                f"{tokenizer.unk_token!r} (id {unk})"
            )
        ids.append(encoded[0])
    if ids[0] == ids[1]:
        raise ValueError(f"prm.good_token {spec.good_token!r} and prm.bad_token {spec.bad_token!r} are the same "
                         f"token (id {ids[0]})")
    return ids[0], ids[1]


# --------------------------------------------------------------------------------------------- engines
def _layout_and_label_ids(hf_config: Any, spec: PRMSpec, tokenizer: Any) -> tuple[str, tuple[int, int] | None]:
    """The layout of ``hf_config`` (checked against ``spec``) and, for ``lm_tokens``, the label token ids.

    A config naming no architectures is a causal LM's (transformers writes a bare ``Qwen2Config`` that way). A
    causal LM is an ``lm_tokens`` PRM, or a ``likelihood`` one when ``spec`` says so."""
    layout = config_layout(hf_config)
    if layout == "lm_tokens" and spec.layout == "likelihood":
        return "likelihood", None
    if layout != spec.layout:
        raise ValueError(
            f"prm.layout is {spec.layout!r} but the HF config's architectures "
            f"{_config_field(hf_config, 'architectures')} make a {layout!r} PRM (write the PRM's config with "
            "prm.model.prm_hf_config_from_policy)"
        )
    return layout, (label_token_ids(tokenizer, spec) if layout == "lm_tokens" else None)


def _head_of(hf_config: Any, spec: PRMSpec, tokenizer: Any) -> tuple[Callable[[], torch.nn.Module], bool]:
    """(head factory, whether the backbone has an LM output layer) of ``spec`` on the Megatron model of
    ``hf_config``."""
    layout, label_ids = _layout_and_label_ids(hf_config, spec, tokenizer)
    if layout == "classifier":
        hidden_size = int(_config_field(hf_config, "hidden_size"))
        return (lambda: ClassifierHead(hidden_size)), False
    if layout == "likelihood":
        return StepLikelihoodHead, True
    return (lambda: LabelTokenHead(*label_ids)), True


def _deepspeed_prm_engine(hf_config: Any, spec: PRMSpec, tokenizer: Any, *, deepspeed, train: bool, **engine_args):
    """The PRM's transformers model (``prm.hf_model``) on a DeepSpeed engine (training or forward-only)."""
    from grpo_mega.engine.deepspeed_engine import DeepSpeedEngine, DeepSpeedForwardEngine
    from prm.hf_model import build_hf_prm

    if deepspeed is None:
        raise ValueError("engine_kind='deepspeed' needs the deepspeed settings (grpo_mega.config.DeepSpeedConfig)")
    if spec.layout == "likelihood":
        raise ValueError("prm.layout=likelihood runs on the megatron engine (engine=megatron); the deepspeed PRM "
                         "engine has the classifier and lm_tokens layouts")
    module = build_hf_prm(hf_config, *_layout_and_label_ids(hf_config, spec, tokenizer))
    engine_class = DeepSpeedEngine if train else DeepSpeedForwardEngine
    return engine_class(module, hf_config=hf_config, settings=deepspeed, megatron_stage=build_conversion_stage,
                        **engine_args)


def _check_engine_kind(engine_kind: str) -> None:
    if engine_kind not in ("megatron", "deepspeed"):
        raise ValueError(f"engine={engine_kind!r}: expected 'megatron' or 'deepspeed'")


def build_prm_engine(
    hf_config: Any,
    spec: PRMSpec,
    tokenizer: Any,
    *,
    optim,
    total_steps: int,
    max_tokens_per_micro_batch: int,
    dtype: torch.dtype | None = None,
    engine_kind: str = "megatron",
    deepspeed=None,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    distributed_optimizer: bool = True,
):
    """A training engine of the PRM (outputs ``good_logprob``, ``bad_logprob`` per token, not shifted): a
    :class:`~grpo_mega.engine.MegatronEngine` at megatron's current TP / PP / DP (``sequence_parallel``,
    ``recompute``: ``parallel.sequence_parallel`` / ``parallel.recompute``; ``distributed_optimizer``:
    ``parallel.distributed_optimizer``), or with ``engine_kind="deepspeed"``
    a :class:`~grpo_mega.engine.deepspeed_engine.DeepSpeedEngine` with ``deepspeed`` (``config.DeepSpeedConfig``).
    Raises ValueError when ``spec.layout`` is not the layout of ``hf_config`` or (``lm_tokens``) a label token is
    not one token of ``tokenizer``."""
    from grpo_mega.engine.factory import build_engine

    _check_engine_kind(engine_kind)
    if engine_kind == "deepspeed":
        if sequence_parallel or recompute != "none":
            raise ValueError("parallel.sequence_parallel and parallel.recompute need engine=megatron")
        return _deepspeed_prm_engine(hf_config, spec, tokenizer, deepspeed=deepspeed, train=True, optim=optim,
                                     total_steps=total_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    head_factory, lm_output = _head_of(hf_config, spec, tokenizer)
    return build_engine(
        hf_config, head_factory, output_names=OUTPUT_NAMES, next_token_head=False, optim=optim,
        total_steps=total_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch, dtype=dtype,
        lm_output=lm_output, sequence_parallel=sequence_parallel, recompute=recompute,
        distributed_optimizer=distributed_optimizer,
    )


def build_prm_forward_engine(
    hf_config: Any,
    spec: PRMSpec,
    tokenizer: Any,
    *,
    max_tokens_per_micro_batch: int,
    dtype: torch.dtype | None = None,
    engine_kind: str = "megatron",
    deepspeed=None,
    sequence_parallel: bool | None = None,
):
    """The same model on a forward-only engine (scoring): a :class:`~grpo_mega.engine.MegatronForwardEngine`
    (``sequence_parallel``: ``parallel.sequence_parallel``, None = on whenever TP > 1), or a
    :class:`~grpo_mega.engine.deepspeed_engine.DeepSpeedForwardEngine` with ``engine_kind="deepspeed"``."""
    from grpo_mega.engine.factory import build_forward_engine

    _check_engine_kind(engine_kind)
    if engine_kind == "deepspeed":
        return _deepspeed_prm_engine(hf_config, spec, tokenizer, deepspeed=deepspeed, train=False,
                                     max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    head_factory, lm_output = _head_of(hf_config, spec, tokenizer)
    return build_forward_engine(
        hf_config, head_factory, output_names=OUTPUT_NAMES, next_token_head=False,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch, dtype=dtype, lm_output=lm_output,
        sequence_parallel=sequence_parallel,
    )


def build_conversion_stage(hf_config: Any, gpt_config) -> torch.nn.Module:
    """This rank's stage of whatever model an HF folder of ``hf_config`` holds, for the conversion tools: a causal
    LM's backbone, or a classifier PRM's backbone (no LM output layer) with its head on the last stage."""
    from grpo_mega.model import build_gpt_model

    table = architecture_for(hf_config)
    model = build_gpt_model(gpt_config, lm_output=table.lm_output)
    if not table.lm_output and model.post_process:
        model.head = ClassifierHead(int(hf_config.hidden_size))
    return model


# --------------------------------------------------------------------------------------------- HF config
def prm_hf_config_from_policy(policy_hf_dir: str | os.PathLike, out_dir: str | os.PathLike, layout: str) -> Path:
    """Write the HF folder (config.json and the tokenizer files, no weights) of a ``layout`` PRM made from the
    policy in ``policy_hf_dir``; returns ``out_dir``.

    ``classifier``: the policy's config with ``architectures: ["Qwen2ForProcessRewardModel"]`` and
    ``tie_word_embeddings: false`` (the PRM has no LM head to tie); a Qwen2 policy only. ``lm_tokens`` and
    ``likelihood``: the policy's config as it is (``architectures`` filled in from the model type when the policy's has none).
    """
    from grpo_mega.checkpoint.hf_io import copy_side_files

    default_spec(layout)  # validates the layout
    policy_hf_dir, out_dir = Path(policy_hf_dir), Path(out_dir)
    config_path = policy_hf_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{policy_hf_dir}: no config.json to make the PRM's config from")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if layout == "classifier":
        if model_type != "qwen2":
            raise ValueError(f"{config_path}: the classifier layout ({PRM_CLASSIFIER_ARCHITECTURE}) needs a qwen2 "
                             f"policy, model_type is {model_type!r}")
        config.update(architectures=[PRM_CLASSIFIER_ARCHITECTURE], tie_word_embeddings=False)
    elif not config.get("architectures"):
        if model_type not in _CAUSAL_LM_BY_MODEL_TYPE:
            raise ValueError(f"{config_path}: model_type {model_type!r} is not one of "
                             f"{sorted(_CAUSAL_LM_BY_MODEL_TYPE)}")
        config["architectures"] = [_CAUSAL_LM_BY_MODEL_TYPE[model_type]]
    detect_layout(config)
    copy_side_files(policy_hf_dir, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


# --------------------------------------------------------------------------------------------- weights
def _check_backbone_fits(source_config: Any, prm_config: Any, source: Any) -> None:
    """ValueError listing the backbone sizes in which the source model differs from the PRM."""
    differ = [
        f"{name} {_config_field(source_config, name)!r} vs {_config_field(prm_config, name)!r}"
        for name in _BACKBONE_FIELDS
        if _config_field(source_config, name) != _config_field(prm_config, name)
    ]
    if differ:
        raise ValueError(f"{source}: its model does not fit the PRM's backbone (source vs PRM): " + "; ".join(differ))


def _source_config(source: str | os.PathLike, kind: str) -> Any | None:
    """The HF config of the model in ``source`` (of ``weights_format`` ``kind``); None if a checkpoint names none."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint.mcore_checkpoint import read_checkpoint_info
    from grpo_mega.checkpoint.training import checkpoint_config

    if kind == "hf":
        return AutoConfig.from_pretrained(source)
    if kind == "mcore_model":
        return read_checkpoint_info(source)[0]
    hf_dir = (checkpoint_config(source).get("model") or {}).get("hf_config")
    if hf_dir and (Path(hf_dir) / "config.json").is_file():
        return AutoConfig.from_pretrained(hf_dir)
    return None


def _load_training_backbone(engine, source: str | os.PathLike) -> None:
    """Load a training checkpoint's model tensors into the engine, all but the PRM head; collective."""
    from megatron.core import dist_checkpointing

    from grpo_mega.checkpoint.training import locate_checkpoint

    folder = locate_checkpoint(source)
    wanted = {name: value for name, value in engine.model_sharded_state_dict().items()
              if not name.startswith("head.")}
    state = dist_checkpointing.load({"model": wanted}, str(folder))["model"]
    missing, unexpected = engine.stage.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.startswith("head.")]
    if missing or unexpected:
        raise ValueError(f"{folder}: model tensors missing {missing[:8]}, unexpected {unexpected[:8]}")
    engine.reload_after_weight_load()


def load_prm_init_weights(engine, source: str | os.PathLike | None) -> str:
    """Start a PRM engine from a policy's weights: anything ``load_initial_weights`` accepts (HF folder, converted
    megatron folder, grpo-mega training checkpoint or run directory); collective. Returns the format loaded.

    ``lm_tokens``: exactly ``load_initial_weights`` (the PRM is the policy's model). ``classifier``: the backbone
    is loaded, the policy's LM head (lm_head / output layer) is not read, and the classifier head keeps its
    initialisation; a source that is itself a classifier PRM gives its head too. Which of these happened is
    logged. Raises ValueError naming the source and the sizes when its model does not fit the PRM's backbone.
    """
    from grpo_mega.checkpoint.hf_convert import load_hf_weights
    from grpo_mega.checkpoint.hf_io import HFWeights
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.training import load_model_only
    from grpo_mega.checkpoint.training_files import weights_format

    if source is None or architecture_for(engine.hf_config).lm_output:
        if source is not None:
            source_config = _source_config(source, weights_format(source))
            if source_config is not None:
                _check_backbone_fits(source_config, engine.hf_config, source)
        return load_initial_weights(engine, source)
    kind = weights_format(source)
    source_config = _source_config(source, kind)
    if source_config is not None:
        _check_backbone_fits(source_config, engine.hf_config, source)
    with_head = source_config is not None and not architecture_for(source_config).lm_output
    if getattr(engine, "engine_name", "megatron") == "deepspeed":
        from prm.hf_model import load_backbone_weights

        if with_head:
            load_initial_weights(engine, source)
        else:
            load_backbone_weights(engine, source)
    elif kind == "hf":
        if with_head:
            engine.load_hf_weights(HFWeights(source))
        else:
            load_hf_weights(engine.stage, HFWeights(source), source_config, skip_lm_output=True)
            engine.reload_after_weight_load()
    elif kind == "mcore_model":
        engine.load_mcore_model(str(source))  # reads the head only from a classifier PRM's folder
    elif with_head:
        load_model_only(engine, source)
    else:
        _load_training_backbone(engine, source)
    logger.info(
        "classifier PRM initialised from %s (%s): backbone loaded, %s", source, kind,
        "classifier head loaded too (the source is a classifier PRM)" if with_head else
        "the source's LM head ignored, the classifier head keeps its random initialisation",
    )
    return kind


# --------------------------------------------------------------------------------------------- opening a PRM
@dataclass
class LoadedPRM:
    """A PRM ready to score: its forward-only engine, how it reads solutions, its tokenizer and HF config."""

    engine: Any
    """A forward-only engine (Megatron or DeepSpeed) with outputs ``good_logprob`` / ``bad_logprob``."""
    spec: PRMSpec
    tokenizer: Any
    hf_config: Any


def _load_tokenizer(folder: str | os.PathLike, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{what}: no tokenizer could be loaded from {folder} ({error})") from None


def _training_checkpoint_parts(path: str | os.PathLike, layout: str | None = None) -> tuple[Any, PRMSpec, Any]:
    """(HF config, spec, tokenizer) of a grpo-mega PRM checkpoint, from its saved run config; with ``layout``
    ``likelihood`` also of a policy's checkpoint (SFT or GRPO: a causal LM, no prm section)."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint.training import checkpoint_config

    config = checkpoint_config(path)
    model = config.get("model") or {}
    hf_dir = model.get("hf_config")
    if not hf_dir or not (Path(hf_dir) / "config.json").is_file():
        raise ValueError(f"{path}: the checkpoint's config model.hf_config ({hf_dir!r}) has no config.json")
    if "prm" in config:
        # The prm section also holds the rendering settings (prm.config.PRMHeadConfig): keep the spec's fields.
        spec_fields = {field.name for field in dataclasses.fields(PRMSpec)}
        spec = PRMSpec.from_dict({k: v for k, v in (config["prm"] or {}).items() if k in spec_fields},
                                 where=f"{path}: prm")
    elif layout == "likelihood":
        spec = default_spec("likelihood")
    else:
        raise ValueError(f"{path}: the checkpoint's config has no prm section: not a PRM checkpoint (a policy's "
                         "checkpoint can score steps as a likelihood PRM: --layout likelihood)")
    tokenizer = _load_tokenizer(model.get("tokenizer") or hf_dir, f"{path}: model.tokenizer")
    return AutoConfig.from_pretrained(hf_dir), spec, tokenizer


def check_layout_is_known(path: str | os.PathLike, key: str) -> None:
    """ValueError naming ``key`` when ``path`` is a plain causal LM (an HF or converted folder, or a policy's
    training checkpoint) and no layout was chosen: it reads as a PRM two ways, and taking ``lm_tokens`` silently
    gives meaningless scores on a model never trained with label tokens."""
    from grpo_mega.checkpoint.mcore_checkpoint import read_checkpoint_info
    from grpo_mega.checkpoint.training_files import weights_format

    try:
        kind = weights_format(path)
    except ValueError:
        return  # open_prm reports the unusable path
    if kind == "hf":
        from transformers import AutoConfig

        layout = config_layout(AutoConfig.from_pretrained(path))
    elif kind == "mcore_model":
        layout = config_layout(read_checkpoint_info(path)[0])
    else:
        from grpo_mega.checkpoint.training import checkpoint_config

        if not (checkpoint_config(path).get("prm") or {}).get("layout"):
            raise ValueError(f"{path} is a policy's training checkpoint, which reads as a PRM only by its own "
                             f"probability of each step: choose {key} likelihood (add likelihood_tokens=result for "
                             "natural-language steps)")
        layout = None
    if layout == "lm_tokens":
        raise ValueError(
            f"{path} is a causal LM, which reads as a PRM two ways; choose one with {key}: lm_tokens (a "
            "Math-Shepherd-style PRM trained to write a good/bad label token after each step) or likelihood (the "
            "LM's own probability of each step: a self-consistency signal, e.g. from the SFT policy; add "
            "likelihood_tokens=result for natural-language steps)")


def open_prm(
    path: str | os.PathLike,
    *,
    spec_overrides: dict | None = None,
    max_tokens_per_micro_batch: int = 4096,
    engine_kind: str = "megatron",
    deepspeed=None,
) -> LoadedPRM:
    """A forward-only PRM from ``path``; collective, after ``grpo_mega.parallel.init_distributed`` (any TP/PP/DP;
    ``engine_kind="deepspeed"``: TP = PP = 1, a DeepSpeed forward engine with ``deepspeed``, any of the formats).

    ``path`` is an HF PRM folder of either layout (layout from its config.json, spec = ``default_spec`` of it), a
    converted megatron folder of one (``tools/convert_hf_to_mcore.py``), or a grpo-mega PRM training checkpoint /
    run directory (HF config, tokenizer and spec from its saved config: ``model.hf_config``, ``model.tokenizer``,
    ``prm``), or with ``spec_overrides={"layout": "likelihood", ...}`` a policy's training checkpoint.
    ``spec_overrides`` replaces spec fields (e.g. ``{"step_tag": "\\n\\n"}``). Raises ValueError for an
    unknown override, a layout the config contradicts, or a folder that is none of these.
    """
    from transformers import AutoConfig

    from grpo_mega.checkpoint.hf_io import HFWeights
    from grpo_mega.checkpoint.mcore_checkpoint import HF_FILES_DIR, read_checkpoint_info
    from grpo_mega.checkpoint.training import load_model_only
    from grpo_mega.checkpoint.training_files import weights_format

    try:
        kind = weights_format(path)
    except ValueError as error:  # weights_format speaks of init_from; here the path is a PRM
        raise ValueError(f"PRM {path}: {str(error).removeprefix('init_from: ')}") from None
    overrides = dict(spec_overrides or {})
    if kind == "hf":
        hf_config = AutoConfig.from_pretrained(path)
        spec, tokenizer = default_spec(config_layout(hf_config)), _load_tokenizer(path, str(path))
    elif kind == "mcore_model":
        hf_config = read_checkpoint_info(path)[0]
        spec = default_spec(config_layout(hf_config))
        tokenizer = _load_tokenizer(Path(path) / HF_FILES_DIR, str(path))
    else:
        hf_config, spec, tokenizer = _training_checkpoint_parts(path, overrides.get("layout"))
    spec = PRMSpec.from_dict({**spec.to_dict(), **overrides}, where="spec_overrides")
    engine = build_prm_forward_engine(hf_config, spec, tokenizer, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                      engine_kind=engine_kind, deepspeed=deepspeed)
    if kind == "hf":
        engine.load_hf_weights(HFWeights(path))
    elif kind == "mcore_model":
        engine.load_mcore_model(str(path))
    else:
        load_model_only(engine, path)
    return LoadedPRM(engine=engine, spec=spec, tokenizer=tokenizer, hf_config=hf_config)
