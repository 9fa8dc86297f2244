"""The policy backbone: megatron-core's GPTModel for this rank's pipeline stage, returning hidden
states.

The last stage returns the final-normed hidden states [S, B, H] instead of logits: what is computed
from them (next-token log-probs and entropy, PRM step scores, ...) is a pluggable head
(`grpo_mega.model.heads`). The output layer's parameters stay in the model: they are the LM head's
weight, and checkpoints and HF conversion see the same names as a stock GPTModel.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from grpo_mega.model.config_map import GPTConfig
from grpo_mega.parallel.distributed import get_device


class HiddenStatesGPTModel(GPTModel):
    """GPTModel whose last pipeline stage returns final-normed hidden states [S, B, H], not logits.

    Other stages return their output activations, as GPTModel does. `vocab_size` is the padded size
    megatron shards; `unpadded_vocab_size` is the number of real tokens (rows past it are padding
    that heads must ignore).
    """

    def __init__(self, *args, unpadded_vocab_size: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.mtp_process:
            raise ValueError("multi-token prediction is not supported by HiddenStatesGPTModel")
        self.unpadded_vocab_size = unpadded_vocab_size

    def _postprocess(self, hidden_states, labels=None, **unused):
        """Return the decoder output (the decoder applies the final norm on the last stage)."""
        if labels is not None:
            raise ValueError(
                "HiddenStatesGPTModel does not compute a loss from labels: apply a head "
                "(grpo_mega.model.heads) to the hidden states it returns"
            )
        return hidden_states

    def lm_output_weight(self) -> torch.Tensor:
        """This rank's vocab shard [padded_vocab / tp, H] of the LM output matrix (last stage only).

        The word embedding when embeddings are tied and this stage also holds them, otherwise the
        output layer's weight (with tied embeddings across stages, megatron keeps that copy equal to
        the first stage's embedding).
        """
        if not self.post_process:
            raise ValueError("the LM output weight lives on the last pipeline stage only")
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight


def transformer_layer_spec() -> ModuleSpec:
    """Transformer Engine layers on GPU when TE is installed, else megatron-core's own layers."""
    if get_device().type == "cuda":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            pass
        else:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(
    config: GPTConfig,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
) -> HiddenStatesGPTModel:
    """Build this rank's stage of the policy from a `GPTConfig` (needs megatron parallel state).

    pre_process (embedding) and post_process (final norm, output layer) default to whether this rank
    is the first / last pipeline stage. Parameters are on the current device (CPU without CUDA).
    """
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = HiddenStatesGPTModel(
        config=config.transformer,
        transformer_layer_spec=transformer_layer_spec(),
        vocab_size=config.padded_vocab_size,
        unpadded_vocab_size=config.vocab_size,
        max_sequence_length=config.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=config.rotary_base,
        rope_scaling=config.rope_scaling_factor is not None,
        rope_scaling_factor=config.rope_scaling_factor or 1.0,
    )
    device = get_device()
    if device.type == "cuda":
        model.cuda(device)
    return model
