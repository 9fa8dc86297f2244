"""What a PRM is and how it reads solutions: the PRM rules in one place.

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

The rules: a spec (:class:`PRMSpec`) is checked once, when it is made (the likelihood layout has no step tag, and
switching a spec to it drops the tag: :func:`spec_with_overrides`); the spec and rendering a PRM was trained with
come from its model source (``grpo_mega.checkpoint.source.ModelSource``: an HF or converted folder's
architectures, a grpo-mega checkpoint's ``prm`` section: :func:`trained_spec`, :meth:`PRMChoices.render_settings`);
a plain causal LM must be given a layout (:func:`check_layout_is_known`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_mega.checkpoint.source import ModelSource
from prm.rendering import RenderSettings

PRM_LAYOUTS = ("classifier", "lm_tokens", "likelihood")
CLASSIFIER_STEP_TAG = "<extra_0>"
"""Qwen2.5-Math-PRM's step separator."""
LM_TOKENS_STEP_TAG = " ки"
"""Math-Shepherd's step tag."""
NO_STEP_TAG = ""
"""The likelihood layout's tag: none, the steps are read as written."""
_CAUSAL_LM_BY_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
        if self.layout == "likelihood" and self.step_tag != NO_STEP_TAG:
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
            missing.remove("step_tag")
            data = {**data, "step_tag": NO_STEP_TAG}
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
        return PRMSpec("likelihood", NO_STEP_TAG)
    raise ValueError(f"PRM layout must be one of {PRM_LAYOUTS}, got {layout!r}")


def config_field(hf_config: Any, name: str) -> Any:
    """Field ``name`` of an HF config object or config.json dict (None when absent)."""
    return hf_config.get(name) if isinstance(hf_config, Mapping) else getattr(hf_config, name, None)


def detect_layout(hf_config: Any) -> str:
    """The PRM layout of an HF config (object or config.json dict), from its ``architectures``:
    Qwen2ForProcessRewardModel (or Qwen3ForProcessRewardModel) -> ``classifier``, a ``*ForCausalLM`` ->
    ``lm_tokens``; ValueError otherwise."""
    architectures = list(config_field(hf_config, "architectures") or [])
    if any(name.endswith("ForCausalLM") for name in architectures):  # first, without torch: the CLI checks it
        return "lm_tokens"
    from grpo_mega.checkpoint.prm_architectures import PRM_CLASSIFIER_ARCHITECTURES, is_prm_classifier  # no torch

    if is_prm_classifier(architectures):
        return "classifier"
    raise ValueError(
        f"cannot tell the PRM layout from the HF config's architectures {architectures}: expected "
        f"one of {sorted(PRM_CLASSIFIER_ARCHITECTURES.values())} (classifier) or a *ForCausalLM (lm_tokens)"
    )


def config_layout(hf_config: Any) -> str:
    """``detect_layout``, with a config that names no architectures taken as a causal LM's (``lm_tokens``):
    transformers writes a bare ``Qwen2Config`` that way."""
    return detect_layout(hf_config) if config_field(hf_config, "architectures") else "lm_tokens"


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


def layout_and_label_ids(hf_config: Any, spec: PRMSpec, tokenizer: Any) -> tuple[str, tuple[int, int] | None]:
    """The layout of ``hf_config`` (checked against ``spec``) and, for ``lm_tokens``, the label token ids.

    A config naming no architectures is a causal LM's (transformers writes a bare ``Qwen2Config`` that way). A
    causal LM is an ``lm_tokens`` PRM, or a ``likelihood`` one when ``spec`` says so."""
    layout = config_layout(hf_config)
    if layout == "lm_tokens" and spec.layout == "likelihood":
        return "likelihood", None
    if layout != spec.layout:
        raise ValueError(
            f"prm.layout is {spec.layout!r} but the HF config's architectures "
            f"{config_field(hf_config, 'architectures')} make a {layout!r} PRM (write the PRM's config with "
            "prm.spec.prm_hf_config_from_policy)"
        )
    return layout, (label_token_ids(tokenizer, spec) if layout == "lm_tokens" else None)


# --------------------------------------------------------------------------------------------- HF config
def prm_hf_config_from_policy(policy_hf_dir: str | os.PathLike, out_dir: str | os.PathLike, layout: str) -> Path:
    """Write the HF folder (config.json and the tokenizer files, no weights) of a ``layout`` PRM made from the
    policy in ``policy_hf_dir``; returns ``out_dir``.

    ``classifier``: the policy's config with ``architectures: ["Qwen2ForProcessRewardModel"]`` (a Qwen3 policy:
    ``Qwen3ForProcessRewardModel``) and ``tie_word_embeddings: false`` (the PRM has no LM head to tie); a Qwen2 or
    Qwen3 policy only. ``lm_tokens`` and
    ``likelihood``: the policy's config as it is (``architectures`` filled in from the model type when the policy's has none).
    """
    from grpo_mega.checkpoint.hf_io import copy_side_files
    from grpo_mega.checkpoint.prm_architectures import PRM_CLASSIFIER_ARCHITECTURES

    default_spec(layout)  # validates the layout
    policy_hf_dir, out_dir = Path(policy_hf_dir), Path(out_dir)
    config_path = policy_hf_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{policy_hf_dir}: no config.json to make the PRM's config from")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if layout == "classifier":
        if model_type not in PRM_CLASSIFIER_ARCHITECTURES:
            raise ValueError(f"{config_path}: the classifier layout needs a policy of model_type "
                             f"{' or '.join(sorted(PRM_CLASSIFIER_ARCHITECTURES))}, model_type is {model_type!r}")
        config.update(architectures=[PRM_CLASSIFIER_ARCHITECTURES[model_type]], tie_word_embeddings=False)
    elif not config.get("architectures"):
        if model_type not in _CAUSAL_LM_BY_MODEL_TYPE:
            raise ValueError(f"{config_path}: model_type {model_type!r} is not one of "
                             f"{sorted(_CAUSAL_LM_BY_MODEL_TYPE)}")
        config["architectures"] = [_CAUSAL_LM_BY_MODEL_TYPE[model_type]]
    detect_layout(config)
    copy_side_files(policy_hf_dir, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


# --------------------------------------------------------------------------------------------- the spec of a source
def spec_with_overrides(spec: PRMSpec, overrides: Mapping[str, Any] | None) -> PRMSpec:
    """``spec`` with the fields of ``overrides`` replaced (ValueError for an unknown one, or a combination the spec
    rejects). Switching to the likelihood layout without naming a tag drops the tag: that layout has none."""
    overrides = dict(overrides or {})
    if overrides.get("layout") == "likelihood" and "step_tag" not in overrides:
        overrides["step_tag"] = NO_STEP_TAG
    return PRMSpec.from_dict({**spec.to_dict(), **overrides}, where="spec_overrides")


def trained_spec(source: ModelSource, layout: str | None = None) -> PRMSpec:
    """The spec a PRM was trained with: for an HF or converted folder the published convention of the layout its
    config's architectures name (``default_spec``); for a grpo-mega PRM checkpoint the spec fields of its ``prm``
    section; with ``layout`` ``likelihood`` a policy's checkpoint (SFT or GRPO: a causal LM, no prm section) is a
    likelihood PRM. ValueError for a checkpoint that is neither."""
    if not source.is_checkpoint:
        return default_spec(config_layout(source.hf_config))
    if "prm" in (source.run_config or {}):
        # The prm section also holds the rendering settings (prm.config.PRMHeadConfig): keep the spec's fields.
        spec_fields = {field.name for field in dataclasses.fields(PRMSpec)}
        return PRMSpec.from_dict({k: v for k, v in source.trained_prm.items() if k in spec_fields},
                                 where=f"{source.path}: prm")
    if layout == "likelihood":
        return default_spec("likelihood")
    raise ValueError(f"{source.path}: the checkpoint's config has no prm section: not a PRM checkpoint (a policy's "
                     "checkpoint can score steps as a likelihood PRM: --layout likelihood)")


def check_layout_is_known(path: str | os.PathLike, key: str) -> None:
    """ValueError naming ``key`` when ``path`` is a plain causal LM (an HF or converted folder, or a policy's
    training checkpoint) and no layout was chosen: it reads as a PRM two ways, and taking ``lm_tokens`` silently
    gives meaningless scores on a model never trained with label tokens. A path that is no model is left to
    ``prm.model.open_prm`` to report."""
    from grpo_mega.checkpoint.source import CHECKPOINT_KINDS, model_path_summary

    try:  # read without transformers' import (seconds of torch): the CLI checks this before it launches
        kind, run_config, hf_config = model_path_summary(path)
    except (ValueError, OSError):
        return
    if kind in CHECKPOINT_KINDS:
        if not ((run_config or {}).get("prm") or {}).get("layout"):
            raise ValueError(f"{path} is a policy's training checkpoint, which reads as a PRM only by its own "
                             f"probability of each step: choose {key} likelihood (add likelihood_tokens=result for "
                             "natural-language steps)")
        return
    if hf_config is not None and config_layout(hf_config) == "lm_tokens":
        raise ValueError(
            f"{path} is a causal LM, which reads as a PRM two ways; choose one with {key}: lm_tokens (a "
            "Math-Shepherd-style PRM trained to write a good/bad label token after each step) or likelihood (the "
            "LM's own probability of each step: a self-consistency signal, e.g. from the SFT policy; add "
            "likelihood_tokens=result for natural-language steps)")


# --------------------------------------------------------------------------------------------- choices at scoring time
_SPEC_CHOICES = ("layout", "step_tag", "good_token", "bad_token")


@dataclass(frozen=True)
class PRMChoices:
    """How to read solutions with a PRM where it should differ from how the PRM was trained; each None keeps the
    PRM's own: its layout, tag and label tokens (``trained_spec``), and for a grpo-mega PRM the chat-template and
    likelihood settings it was trained with (an HF or converted folder: no chat template, all tokens)."""

    layout: str | None = None
    step_tag: str | None = None
    good_token: str | None = None
    bad_token: str | None = None
    chat_template: bool | None = None
    system_prompt: str | None = None
    likelihood_tokens: str | None = None
    scorer: str | None = None
    """What runs the PRM: ``engine`` (None: a forward-only copy on the trainer's engine) or ``vllm``
    (``prm.vllm_scoring``)."""
    vllm_tensor_parallel: int | None = None
    """``scorer: vllm``: ranks per vLLM replica (None: 1)."""
    vllm_gpu_memory_utilization: float | None = None
    """``scorer: vllm``: share of each GPU for the PRM (None: 0.2)."""

    @classmethod
    def of(cls, settings: Any) -> PRMChoices:
        """The choices of an object with these attributes: ``ProcessRewardConfig``, the ``prm score`` flags (an
        attribute it lacks keeps the PRM's own)."""
        return cls(**{field.name: getattr(settings, field.name, None) for field in dataclasses.fields(cls)})

    def spec_overrides(self) -> dict[str, str]:
        """The spec fields chosen (for ``spec_with_overrides``)."""
        return {name: getattr(self, name) for name in _SPEC_CHOICES if getattr(self, name) is not None}

    def render_settings(self, spec: PRMSpec, source: ModelSource) -> RenderSettings:
        """The rendering of ``spec`` (the spec in use) with these choices over those ``source`` was trained with."""
        saved = source.trained_prm
        return RenderSettings(
            step_tag=spec.step_tag,
            chat_template=self.chat_template if self.chat_template is not None else bool(saved.get("chat_template",
                                                                                                     False)),
            system_prompt=self.system_prompt if self.system_prompt is not None else saved.get("system_prompt"),
            likelihood_tokens=self.likelihood_tokens or saved.get("likelihood_tokens") or "all",
        )
