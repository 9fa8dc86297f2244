"""What runs inside a vLLM worker for grpo-mega: the weight-sync extension, the CPU backend's weight packing, and
the logits processor that keeps sampling inside the tokenizer's vocabulary.

The extension (:class:`VLLMWeightReceiver`) is mixed into every vLLM worker by ``worker_extension_cls`` and called
through ``LLM.collective_rpc``. The engine core runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
which ``external_launcher`` also requires), so the tensors reach ``model.load_weights`` without being serialised.

vLLM's CPU backend (0.32) packs linear and embedding weights for its GEMM kernels after loading (oneDNN handles or
sgl-kernel packed copies, ``dispatch_cpu_unquantized_gemm``) and, for linear layers, deletes the plain weight. A
later ``load_weights`` would then find empty tensors, and the packed copies would keep the old values. So on CPU
the engine is built inside :func:`keep_cpu_weights` (the plain weights stay), and after every complete sync the
extension packs the new weights again (:meth:`VLLMWeightReceiver.grpo_finish_weight_sync`). GPU backends read
unquantized weights in place and need neither.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def keep_cpu_weights() -> Iterator[None]:
    """While building an ``LLM`` on vLLM's CPU backend: pack weights without deleting the plain ones, so that
    ``load_weights`` can overwrite them later. No effect on other platforms."""
    if not _on_cpu():
        yield
        return
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    # linear.py and vocab_parallel_embedding.py import the function from the module at call time.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    experts_cls = _cpu_moe_experts_class()
    original_moe = experts_cls.process_weights_after_loading
    experts_cls.process_weights_after_loading = _keeping_plain_moe_weights(original_moe)
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original
        experts_cls.process_weights_after_loading = original_moe


# vLLM's CPU MoE experts (0.32, ``CPUUnquantizedExperts.process_weights_after_loading``) replace an MoE layer's
# ``w13_weight`` / ``w2_weight`` by padded, prepacked copies for their grouped GEMM once, when the engine is built; a
# later ``load_weights`` would write checkpoint-layout rows into the packed tensors. So while the engine is built the
# plain parameters (with their weight loaders) are kept on the layer (``_PLAIN_MOE``); a sync puts them back before
# loading (``restore_plain_moe_weights``) and prepacks again after it (``prepack_moe_weights``).
_PLAIN_MOE = "_grpo_mega_plain_moe_weights"


def _cpu_moe_experts_class():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return CPUUnquantizedExperts


def _keeping_plain_moe_weights(process):
    def process_keeping_plain(self, layer: torch.nn.Module) -> None:
        setattr(layer, _PLAIN_MOE, (layer.w13_weight, layer.w2_weight))
        process(self, layer)
        if getattr(self, "_use_zentorch", False):  # zentorch kept the plain weights: nothing to restore
            delattr(layer, _PLAIN_MOE)

    return process_keeping_plain


def _packed_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if hasattr(module, _PLAIN_MOE)]


def restore_plain_moe_weights(model: torch.nn.Module) -> int:
    """Put the plain expert weights back as the MoE layers' parameters, for ``load_weights``; returns how many
    layers."""
    layers = _packed_moe_layers(model)
    for layer in layers:
        layer.w13_weight, layer.w2_weight = getattr(layer, _PLAIN_MOE)
    return len(layers)


def prepack_moe_weights(model: torch.nn.Module) -> int:
    """Pad and prepack the loaded plain expert weights for vLLM's CPU grouped GEMM (keeping the plain ones again);
    returns how many layers."""
    layers = _packed_moe_layers(model)
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(layers)


def repack_cpu_weights(model: torch.nn.Module) -> int:
    """Rebuild the CPU GEMM packing of every layer that has one from its current weight; returns how many."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    seen: set[int] = set()
    for module in model.modules():
        if id(module) in seen or not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue
        seen.add(id(module))
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.numel() == 0:
            raise RuntimeError(
                f"vllm weight sync: {type(module).__name__} has no plain 2-D weight to pack; was the engine built "
                "inside keep_cpu_weights()?"
            )
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        repacked += 1
    return repacked


class VLLMWeightReceiver:
    """vLLM worker extension (``worker_extension_cls``): receives HF-named full tensors through
    ``LLM.collective_rpc``. Method names carry a prefix because vLLM refuses extension attributes that its Worker
    already has (0.32's Worker has ``update_weights``)."""

    def grpo_load_hf_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors into this worker's model (vLLM fuses q/k/v and gate/up and keeps its own
        tensor-parallel shard); returns how many were given."""
        from vllm.config import set_current_vllm_config

        on_device = ((name, tensor.to(self.device)) for name, tensor in named_tensors)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.model.load_weights(on_device)
        return len(named_tensors)

    def grpo_begin_weight_sync(self) -> int:
        """Before the first bucket: on CPU, the MoE layers' plain expert weights back in place of their packed copies
        (returns how many layers; 0 on other platforms, whose kernels read the parameters as loaded)."""
        return restore_plain_moe_weights(self.model_runner.model) if _on_cpu() else 0

    def grpo_finish_weight_sync(self) -> int:
        """After the last bucket: on CPU, pack the new weights for the GEMM kernels, MoE experts included (returns
        the number of layers repacked; 0 on other platforms)."""
        if not _on_cpu():
            return 0
        return repack_cpu_weights(self.model_runner.model) + prepack_moe_weights(self.model_runner.model)


SAMPLED_VOCAB_KEY = "grpo_mega_sampled_vocab_size"
"""Key of the engine's ``hf_overrides`` that gives :class:`TokenizerVocabMask` the tokenizer's size."""


class TokenizerVocabMask(V1LogitsProcessor, V2LogitsProcessor):
    """Never sample a token id the tokenizer does not have (``logits[:, len(tokenizer):] = -inf``, as verl does).

    Checkpoints pad their embedding past the tokenizer (Qwen2.5: 152,064 rows for 151,665 tokens) and vLLM samples
    over every row. The size comes from the model config's ``grpo_mega_sampled_vocab_size``, set by the engine
    through ``hf_overrides``. Applied to every request, greedy included (it can change the argmax); both runners
    apply it before temperature and top-k / top-p, so ``processed_logprobs`` are normalised over the tokenizer's ids.

    One class for both of vLLM's model runners, because which one runs is decided inside ``vllm.LLM`` after its
    arguments are fixed (``VllmConfig.use_v2_model_runner``: ``VLLM_USE_V2_MODEL_RUNNER``, then Triton, then the
    features V2 lacks): on a GPU with Triton, Model Runner V2, whose loader accepts only subclasses of
    ``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`` and builds them as ``(vllm_config,
    req_states)``, calling ``apply(logits, ctx)``; on vLLM's CPU backend (no Triton) or where V2 lacks a feature, the
    V1 runner, whose loader accepts only subclasses of ``vllm.v1.sample.logits_processor.LogitsProcessor`` and builds
    them as ``(vllm_config, device, is_pin_memory)``, calling ``apply(logits)``. Each loader checks only its own base
    class, so subclassing both passes either; the mask needs no per-request state, which is the only place the two
    interfaces differ beyond their signatures (V2's ``add_request`` returns True: every request is masked)."""

    def __init__(self, vllm_config, *runner_state):
        """``runner_state``: (device, is_pin_memory) from the V1 runner, (req_states,) from V2; neither is needed."""
        self.limit = getattr(vllm_config.model_config.hf_config, SAMPLED_VOCAB_KEY, None)

    def is_argmax_invariant(self) -> bool:
        """V1: the mask can change the argmax, so greedy requests go through it too."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """V1: nothing per request: the mask is the same for every row."""

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        """Both runners: V1 passes the logits alone, V2 the logits and the step's batch layout (``ctx``, unused: every
        row is masked)."""
        if self.limit is not None and logits.shape[-1] > self.limit:
            logits[:, self.limit:] = float("-inf")
        return logits
