"""The policy backbone: megatron-core's GPTModel for this rank's pipeline stage, returning hidden
states.

The last stage returns the final-normed hidden states [S, B, H] instead of logits: what is computed
from them (next-token log-probs and entropy, PRM step scores, ...) is a pluggable head
(`grpo_mega.model.heads`). The output layer's parameters stay in the model: they are the LM head's
weight, and checkpoints and HF conversion see the same names as a stock GPTModel.

A model whose HF form has no LM head (a classifier PRM, Qwen2ForProcessRewardModel) is built with
`lm_output=False`: no output layer, untied, so its checkpoints and gradients carry no unused
vocabulary-sized matrix.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from grpo_mega.model.attention import PackedRows, SDPADotProductAttention, use_sdpa_core_attention
from grpo_mega.model.config_map import GPTConfig
from grpo_mega.model.moe_config import fill_in_missing_te_gemm
from grpo_mega.model.norm import RMSNorm, local_block_spec, use_rms_norm
from grpo_mega.parallel.distributed import get_device

logger = logging.getLogger(__name__)

EXTRA_STATE_SUFFIX = "_extra_state"
"""torch's state-dict name for what a module returns from ``get_extra_state`` (Transformer Engine: FP8 scales)."""


def is_extra_state(key: str) -> bool:
    """Whether a state-dict or sharded-checkpoint key is a module's ``_extra_state`` entry."""
    return key.endswith(EXTRA_STATE_SUFFIX)


def _ignore_extra_state_mismatches(module: torch.nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook: `_extra_state` entries are not an error either way (see the class docstring).

    torch checks ``strict`` after the post-hooks, on these same lists; other keys stay and still fail.
    """
    incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys if not is_extra_state(key)]
    incompatible_keys.unexpected_keys[:] = [key for key in incompatible_keys.unexpected_keys
                                            if not is_extra_state(key)]


class HiddenStatesGPTModel(GPTModel):
    """GPTModel whose last pipeline stage returns final-normed hidden states [S, B, H], not logits.

    Other stages return their output activations, as GPTModel does. `vocab_size` is the padded size
    megatron shards; `unpadded_vocab_size` is the number of real tokens (rows past it are padding
    that heads must ignore). With `lm_output=False` the last stage has no `output_layer` (and the
    embeddings cannot be tied): its head works from the hidden states alone.

    Checkpoints move between machines with and without Transformer Engine: TE modules keep quantization metadata
    as `_extra_state` entries that megatron's own modules do not have (``decoder.final_layernorm._extra_state``:
    megatron builds the final norm with TE whenever TE imports, whatever the layer spec). `load_state_dict`
    therefore ignores `_extra_state` mismatches both ways: an entry the state lacks leaves the module's own, an
    entry the model lacks is dropped; every other missing or unexpected key fails as usual.
    (`grpo_mega.checkpoint.extra_state` does the same for dist_checkpointing loads.)
    """

    def __init__(self, *args, unpadded_vocab_size: int, lm_output: bool = True, **kwargs) -> None:
        if not lm_output and kwargs.get("share_embeddings_and_output_weights"):
            raise ValueError("a model without an LM output layer cannot tie it to the embeddings")
        super().__init__(*args, **kwargs)
        if self.mtp_process:
            raise ValueError("multi-token prediction is not supported by HiddenStatesGPTModel")
        self.unpadded_vocab_size = unpadded_vocab_size
        self.lm_output = lm_output
        self.register_load_state_dict_post_hook(_ignore_extra_state_mismatches)
        if self.post_process and not lm_output:
            # GPTModel always builds the output layer on the last stage; drop it before any DDP
            # buffer, optimizer or checkpoint sees it. Untied, nothing else refers to it (megatron
            # reads it only for tied embeddings, MTP or deferred embedding wgrad, all off here).
            # Its shard [padded_vocab / tp, H] exists only during construction.
            del self.output_layer

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's sharded state dict; without an output layer, the generic one of the submodules.

        LanguageModule marks the last stage's `output_layer.weight` (padding may differ on load)
        and GPTModel drops its `_extra_state`: both about a tensor this model does not have, and
        neither applies to untied embeddings without MTP, the only case built here.
        """
        if self.lm_output or not self.post_process:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if sharded_offsets:
            raise ValueError("unexpected sharded offsets for a whole GPT stage")
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def supports_packed_rows(self) -> bool:
        """Whether every layer's core attention can run packed micro-batches (``grpo_mega.model.attention``: the
        local layers with causal attention, no dropout or window; Transformer Engine's cannot)."""
        return all(isinstance(layer.self_attention.core_attention, SDPADotProductAttention)
                   and layer.self_attention.core_attention.fused for layer in self.decoder.layers)

    def forward(self, input_ids, position_ids, attention_mask, *args, packed_rows: PackedRows | None = None,
                **kwargs):
        """GPTModel's forward; with ``packed_rows`` the input is a packed sequence [1, T] whose rows share their
        prompt tokens (``grpo_mega.engine.shared_prefix``; the rotary positions are ``packed_rows.positions``) and
        the last stage returns the rows' hidden states [L, R, H].

        With sequence parallelism the sequence is padded at its end to a multiple of the TP size (megatron splits
        it over the TP ranks between the layers); causal attention keeps the padding out of every real token's
        view, and the last stage returns the real tokens only, so the padding never reaches a head or a loss."""
        length = input_ids.shape[1]
        padding = self.sequence_padding(length)
        if padding:
            input_ids = F.pad(input_ids, (0, padding))
            if position_ids is not None:
                position_ids = torch.cat((position_ids, position_ids[:, -1:] + torch.arange(
                    1, padding + 1, device=position_ids.device).expand(position_ids.shape[0], -1)), dim=1)
        if packed_rows is None:
            hidden = super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
            return hidden[:length] if self.post_process else hidden
        if not self.supports_packed_rows():
            raise ValueError("packed micro-batches need megatron's local layers (not Transformer Engine)")
        if packed_rows.positions.shape[0] != length:
            raise ValueError(f"packed_rows has {packed_rows.positions.shape[0]} positions for {length} tokens")
        packed_rows = packed_rows.padded(length + padding)
        # The layers' core attention receives the rows as megatron's packed_seq_params (grpo_mega.model.attention).
        hidden = super().forward(input_ids, position_ids, attention_mask, *args, packed_seq_params=packed_rows,
                                 **kwargs)
        if not self.post_process:
            return hidden
        return packed_rows.to_rows(hidden[:, 0]).transpose(0, 1).contiguous()

    def sequence_padding(self, length: int) -> int:
        """Tokens added to a sequence of ``length`` so that sequence parallelism can split it over the TP ranks
        (0 without sequence parallelism)."""
        if not self.config.sequence_parallel:
            return 0
        return -length % self.config.tensor_model_parallel_size

    def _preprocess(self, *args, **kwargs):
        """GPTModel's, with the rotary embedding of each packed token taken at its position in its row."""
        output = super()._preprocess(*args, **kwargs)
        packed = kwargs.get("packed_seq_params")
        if not isinstance(packed, PackedRows):
            return output
        if self.position_embedding_type != "rope" or output[1] is None:
            raise ValueError("packed micro-batches need rotary position embeddings")
        table = self.rotary_pos_emb(int(packed.positions.max()) + 1)  # [max position + 1, 1, 1, dim]
        return (output[0], table.index_select(0, packed.positions), *output[2:])

    def _postprocess(self, hidden_states, labels=None, **unused):
        """Return the decoder output (the decoder applies the final norm on the last stage), on the last stage
        whole.

        With sequence parallelism each TP rank holds a slice [S / tp, B, H] of it; the heads need every token
        (the LM head is vocab-parallel: each rank scores all tokens against its vocabulary shard), so the slices
        are all-gathered here, as megatron's output layer would gather them. The gradient coming back is the
        same on every TP rank (the heads' own reductions have summed it: ``copy_to_tensor_model_parallel_region``
        in ``grpo_mega.model.logprobs``; replicated heads compute it identically), so the backward keeps this
        rank's slice of it (``tensor_parallel_output_grad=False``) instead of reduce-scattering it."""
        if labels is not None:
            raise ValueError(
                "HiddenStatesGPTModel does not compute a loss from labels: apply a head "
                "(grpo_mega.model.heads) to the hidden states it returns"
            )
        if self.config.sequence_parallel and self.post_process:  # other stages pass their slice on
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp
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
        if not self.lm_output:
            raise ValueError(
                "this model was built without an LM output layer (lm_output=False, e.g. a classifier "
                "PRM): a head that needs vocabulary logits cannot run on it"
            )
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight


def transformer_engine_unavailable(device_type: str) -> str | None:
    """Why Transformer Engine layers cannot run here, or None when they can.

    megatron-core's own check decides: ``megatron.core.extensions.transformer_engine.HAVE_TE`` imports
    ``transformer_engine.pytorch`` and so loads TE's compiled extension; an installed package whose extension does
    not load (wrong CUDA or torch build) fails it. TE runs on GPUs only.
    """
    if device_type != "cuda":
        return "no CUDA device"
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.models.gpt import gpt_layer_specs

    if te_extension.HAVE_TE and gpt_layer_specs.HAVE_TE:
        return None
    try:  # megatron swallowed the import error; repeat the import for its message
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # noqa: BLE001 - any failure to load the extension is the reason
        return f"megatron-core cannot import it ({type(error).__name__}: {error})"
    return "megatron-core's check (megatron.core.extensions.transformer_engine.HAVE_TE) failed"


@functools.cache
def _use_transformer_engine(device_type: str) -> bool:
    """The layer choice for this process's device, logged once with its reason."""
    reason = transformer_engine_unavailable(device_type)
    if reason is None:
        logger.info(
            "layers: Transformer Engine. Shared-prompt packing (parallel.share_prompt_prefix) is off with them: "
            "it sends a group's prompt through the layers once, as one packed sequence that only grpo_mega's "
            "attention for megatron's local layers can attend row by row, not TE's; every row carries its own "
            "copy of its prompt instead"
        )
        return True
    # On a GPU the reason matters (TE was expected); on the CPU it is the only choice, so it is not worth a line.
    logger.log(logging.INFO if device_type == "cuda" else logging.DEBUG,
               "layers: megatron-core local layers with torch's fused attention (Transformer Engine: %s)", reason)
    return False


def transformer_layer_spec(config: TransformerConfig | None = None) -> ModuleSpec:
    """Transformer Engine layers on a GPU when megatron-core can load TE (`transformer_engine_unavailable`), else
    megatron-core's own layers with torch's fused attention as their core attention (`grpo_mega.model.attention`)
    and norms that support sequence parallelism (`grpo_mega.model.norm`). Checkpoints load into either
    (`HiddenStatesGPTModel`). ``config`` (the model's) says whether the attention has q/k norms
    (``qk_layernorm``: Qwen3) and the MLP is megatron's MoE layer (``num_moe_experts``: Qwen3-MoE; its experts a
    ``SequentialMLP`` in both specs, `grpo_mega.model.moe_config`); None: a dense model without q/k norms."""
    qk_layernorm = bool(config is not None and config.qk_layernorm)
    num_experts = config.num_moe_experts if config is not None else None
    if _use_transformer_engine(get_device().type):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                         qk_layernorm=qk_layernorm)
    return local_layer_spec(config)


def local_layer_spec(config: TransformerConfig | None = None) -> ModuleSpec:
    """megatron-core's local layers, as :func:`transformer_layer_spec` picks them without Transformer Engine, on any
    device (LoRA adapts their parallel linears: ``grpo_mega.lora``)."""
    qk_layernorm = bool(config is not None and config.qk_layernorm)
    num_experts = config.num_moe_experts if config is not None else None
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=qk_layernorm)
    use_sdpa_core_attention(spec)
    use_rms_norm(spec)
    return spec


def build_gpt_model(
    config: GPTConfig,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    lm_output: bool = True,
    layer_spec: ModuleSpec | None = None,
) -> HiddenStatesGPTModel:
    """Build this rank's stage of the policy from a `GPTConfig` (needs megatron parallel state).

    pre_process (embedding) and post_process (final norm, output layer) default to whether this rank
    is the first / last pipeline stage. `lm_output=False` leaves out the output layer (the model of
    an HF checkpoint without lm_head, e.g. a classifier PRM) and unties the embeddings. `layer_spec`
    None: `transformer_layer_spec(config.transformer)`. Parameters are on the current device (CPU without CUDA).
    """
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if config.transformer.num_moe_experts:
        fill_in_missing_te_gemm()
    if layer_spec is None:
        layer_spec = transformer_layer_spec(config.transformer)
    if getattr(layer_spec.submodules, "input_layernorm", None) is RMSNorm:  # a layer spec of megatron's local layers:
        layer_spec = local_block_spec(config.transformer, layer_spec)  # the block spec, with the final norm to match
    model = HiddenStatesGPTModel(
        config=config.transformer,
        transformer_layer_spec=layer_spec,
        vocab_size=config.padded_vocab_size,
        unpadded_vocab_size=config.vocab_size,
        max_sequence_length=config.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=config.tie_word_embeddings and lm_output,
        lm_output=lm_output,
        position_embedding_type="rope",
        rotary_base=config.rotary_base,
        rope_scaling=config.rope_scaling_factor is not None,
        rope_scaling_factor=config.rope_scaling_factor or 1.0,
    )
    device = get_device()
    if device.type == "cuda":
        model.cuda(device)
    return model
