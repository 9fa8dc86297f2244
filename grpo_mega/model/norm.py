"""RMSNorm for megatron-core's local layers that works with sequence parallelism.

The local layer spec's norm (`WrappedTorchNorm`, what megatron builds without Transformer Engine or apex, i.e. on
every CPU run) refuses `sequence_parallel`: with it each TP rank normalises only its slice of the sequence, so
the norm weight's gradient on a rank covers that slice, and megatron sums the slices over the TP group only for
parameters marked ``sequence_parallel`` (`finalize_model_grads`), which torch's norm is not. `RMSNorm` is
torch's RMSNorm with that mark: the same computation, parameter (``weight``) and checkpoint keys, so layers built
with it load the same checkpoints. Transformer Engine's norm (`TENorm`) marks its weights the same way.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built the way megatron builds its norms, its weight marked for sequence parallelism and in
    the model's dtype (``config.params_dtype``), as Transformer Engine's norm creates it and as megatron's
    ``Float16Module`` casts torch's: an fp32 weight in a bf16 model makes torch fall back from its fused norm
    ("Mismatch dtype") and gives megatron's DDP a second gradient buffer (its buffers are grouped by parameter
    dtype), a layout nothing else in a bf16 run has. The optimizer keeps the fp32 master copy of the weight."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"grpo_mega's local norm is RMSNorm, the model asks for {config.normalization}")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        # megatron all-reduces the gradients of parameters marked so over the TP group (sequence parallelism)
        self.weight.sequence_parallel = config.sequence_parallel


def use_rms_norm(layer_spec: ModuleSpec) -> None:
    """Point a local transformer-layer spec's input and pre-MLP norms, and its q/k norms where it has them (Qwen3),
    at `RMSNorm` (in place). megatron sums the q/k norms' gradients over the TP group by their names
    (``finalize_model_grads``: each TP rank's heads give a part of them), with or without sequence parallelism."""
    layer = layer_spec.submodules
    attention = layer.self_attention.submodules
    norms = [(layer, "input_layernorm"), (layer, "pre_mlp_layernorm")]
    norms += [(attention, name) for name in ("q_layernorm", "k_layernorm")
              if getattr(attention, name, None) not in (None, IdentityOp)]
    for holder, name in norms:
        norm = getattr(holder, name)
        if norm is not WrappedTorchNorm:
            raise ValueError(f"expected megatron's WrappedTorchNorm as {name} in the layer spec, found {norm}")
        setattr(holder, name, RMSNorm)


def local_block_spec(config: TransformerConfig, layer_spec: ModuleSpec) -> TransformerBlockSubmodules:
    """The decoder of this pipeline stage: ``layer_spec`` for each of its layers, and `RMSNorm` as the final norm
    (given a layer spec alone, megatron picks the final norm from what is installed: torch's without TE / apex,
    which refuses sequence parallelism, apex's LayerNorm, which refuses RMSNorm)."""
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=RMSNorm)
