"""The PRM as a Hugging Face model, for the DeepSpeed engine (``engine: deepspeed``).

Both published layouts, with the same outputs as the Megatron heads (``prm.heads``): ``good_logprob`` and
``bad_logprob`` [B, S] at every position t, from token t's own final hidden state (no next-token shift), and
parameters under the Hugging Face checkpoint names, so HF PRM folders load as they are and exports are HF PRMs:

- :class:`HFClassifierPRM` (``classifier``, Qwen2.5-Math-PRM): the transformers backbone as ``model`` (e.g.
  ``Qwen2Model``, no LM head) and ``score`` = Linear(H, H) -> ReLU -> Linear(H, 2) (``score.0.*``, ``score.2.*``),
  class 1 "good", computed in fp32 as the Megatron ``ClassifierHead``.
- :class:`HFLabelTokenPRM` (``lm_tokens``, Math-Shepherd): a causal LM's ``model`` and ``lm_head``; the step score
  is the two-way softmax of the LM logits of the good and bad label tokens, from their two rows of the output matrix
  (the full [tokens, vocab] logits are never formed).

Each head's parameters are read inside its own module's ``forward``: ZeRO-3 gathers a module's parameters in that
module's hooks (see ``grpo_mega.engine.hf_policy``).

:func:`load_backbone_weights` starts a DeepSpeed classifier PRM from a policy (anything ``model.init_from`` accepts),
the classifier head keeping its initialisation, as ``prm.model.load_prm_init_weights`` does on Megatron.
"""

from __future__ import annotations

import torch

from prm.heads import OUTPUT_NAMES, two_class_logprobs

CLASSIFIER_PREFIX = "score."
"""The classifier head's parameters in the HF checkpoint (``score.0.weight`` ...)."""


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def _final_hidden(backbone: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S, H] final-normed hidden states. Rows are right-padded and attention is causal only (no padding mask),
    as in the engines: a real token never attends to padding."""
    return backbone(input_ids=input_ids, position_ids=_positions(input_ids), use_cache=False).last_hidden_state


class FP32Linear(torch.nn.Linear):
    """A Linear computed in fp32 whatever the dtype of its input and parameters (bf16 under DeepSpeed on a GPU)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


class HFClassifierPRM(torch.nn.Module):
    """Qwen2.5-Math-PRM's layout on a transformers backbone; ``forward(input_ids)`` gives {"good_logprob",
    "bad_logprob"} [B, S]."""

    output_names = OUTPUT_NAMES

    def __init__(self, hf_config, *, dtype: torch.dtype = torch.float32):
        from transformers import AutoModel

        super().__init__()
        self.config = hf_config
        # The published folders name their model class as remote code (auto_map); the backbone is the stock one.
        self.model = AutoModel.from_config(hf_config, dtype=dtype, trust_remote_code=False)
        hidden = int(hf_config.hidden_size)
        self.score = torch.nn.Sequential(FP32Linear(hidden, hidden), torch.nn.ReLU(), FP32Linear(hidden, 2))

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.score(_final_hidden(self.model, input_ids))  # [B, S, 2]: (bad, good)
        return two_class_logprobs(logits.flip(-1))


class LabelTokenLogits(torch.nn.Module):
    """The LM output matrix ``weight`` [V, H] (the causal LM's own Parameter, so a tie to the embedding survives)
    as a two-class head: ``forward(hidden [B, S, H])`` gives the fp32 logits [B, S, 2] of (good, bad)."""

    def __init__(self, weight: torch.nn.Parameter, good_id: int, bad_id: int):
        super().__init__()
        self.weight = weight
        self.good_id, self.bad_id = int(good_id), int(bad_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.weight[[self.good_id, self.bad_id]].float()  # [2, H]
        return hidden.float() @ rows.t()


class HFLabelTokenPRM(torch.nn.Module):
    """Math-Shepherd's layout on a transformers causal LM; ``forward(input_ids)`` gives {"good_logprob",
    "bad_logprob"} [B, S], ``good_logprob = log P(good) - log(P(good) + P(bad))`` of the next-token distribution."""

    output_names = OUTPUT_NAMES

    def __init__(self, hf_config, good_id: int, bad_id: int, *, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        super().__init__()
        if good_id == bad_id:
            raise ValueError(f"the good and bad label tokens must differ, both are id {good_id}")
        vocab = int(hf_config.vocab_size)
        if not (0 <= good_id < vocab and 0 <= bad_id < vocab):
            raise ValueError(f"label token ids good={good_id}, bad={bad_id} are outside the vocabulary of {vocab}")
        causal_lm = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        if getattr(causal_lm.lm_head, "bias", None) is not None:
            raise ValueError(f"{type(causal_lm).__name__}: an lm_head with a bias is not supported by the "
                             "DeepSpeed engine")
        self.config = hf_config
        self.model = causal_lm.model
        self.lm_head = LabelTokenLogits(causal_lm.lm_head.weight, good_id, bad_id)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return two_class_logprobs(self.lm_head(_final_hidden(self.model, input_ids)))


def build_hf_prm(hf_config, layout: str, label_ids: tuple[int, int] | None) -> torch.nn.Module:
    """The fp32 HF model of a ``layout`` PRM (``label_ids`` = (good, bad) token ids for ``lm_tokens``)."""
    if layout == "classifier":
        return HFClassifierPRM(hf_config)
    if label_ids is None:
        raise ValueError("an lm_tokens PRM needs the ids of its good and bad label tokens")
    return HFLabelTokenPRM(hf_config, *label_ids)


# --------------------------------------------------------------------------------------------- policy weights
class _HFWeightsReader:
    """Stands in for an engine so that ``grpo_mega.engine.source_weights`` reads any model source as HF-named
    tensors (``weights``): an HF folder, a converted megatron folder (through a CPU megatron copy of the PRM, which
    reads a policy's backbone), a DeepSpeed or a Megatron training checkpoint (its backbone keys only)."""

    def __init__(self, hf_config, build_stage):
        self.hf_config = hf_config
        self.build_stage = build_stage
        self.weights = None
        self._shadow = None

    def load_hf_weights(self, hf_weights) -> None:
        self.weights = hf_weights

    def load_mcore_model(self, directory: str) -> None:
        from grpo_mega.engine.deepspeed_weights import megatron_weights_as_hf

        self.weights = megatron_weights_as_hf(self.hf_config, directory=directory, build_stage=self.build_stage)

    def model_sharded_state_dict(self) -> dict:
        from grpo_mega.engine.deepspeed_weights import MegatronShadow

        self._shadow = MegatronShadow(self.hf_config, self.build_stage)
        # A policy's checkpoint has no PRM head: ask for the backbone only.
        return {name: value for name, value in self._shadow.sharded_state_dict().items()
                if not name.startswith("head.")}

    def load_model_state_dict(self, state: dict) -> None:
        self._shadow.model.load_state_dict(state, strict=False)
        self.weights = self._shadow.hf_weights()

    def reload_after_weight_load(self) -> None:
        """Nothing derives from the weights read."""


def load_backbone_weights(engine, source) -> str:
    """Load the backbone of ``source`` (a policy: HF folder, converted megatron folder, training checkpoint or run
    directory, or its ``ModelSource``) into a DeepSpeed classifier PRM engine; its LM head is not read and the
    classifier head keeps its initialisation. Collective. Returns the format loaded. ValueError naming the source
    when tensors are missing."""
    from grpo_mega.checkpoint.source import resolve_model_source
    from grpo_mega.engine.deepspeed_weights import load_named_weights
    from grpo_mega.engine.source_weights import load_source_weights

    model = resolve_model_source(source)
    reader = _HFWeightsReader(engine.hf_config, engine.megatron_stage)
    load_source_weights(reader, model)
    wanted = [name for name, _ in engine.named_parameters() if not name.startswith(CLASSIFIER_PREFIX)]
    missing = [name for name in wanted if name not in reader.weights]
    if missing:
        raise ValueError(f"{model.path}: the policy's weights lack backbone tensors of the PRM: {missing[:8]}")
    load_named_weights(engine, {name: reader.weights[name] for name in wanted}, optional_prefixes=(CLASSIFIER_PREFIX,))
    engine.reload_after_weight_load()
    return model.kind
