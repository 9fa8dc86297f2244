"""dist_checkpointing loads that move between the Transformer Engine and the local layer specs.

Both specs store the same tensors under the same checkpoint keys (the local spec maps its norms onto TE's fused
names), but not the same `_extra_state` objects: TE modules keep quantization metadata there, which megatron's
own modules do not have. ``decoder.final_layernorm._extra_state`` is one: megatron builds the final norm with TE
(TENorm) whenever TE imports, whatever the layer spec. A checkpoint written on a CPU node (SFT, HF -> megatron
conversion) then lacks objects a model on a TE machine asks for, and megatron's default load fails on the first
of them ("Missing key in checkpoint state_dict: decoder.final_layernorm._extra_state/shard_0_1", the error of
NVIDIA/cosmos#69 for a TE q_layernorm); a plain state dict fails the other way (NVIDIA/Megatron-LM#900:
"Unexpected key(s) in state_dict: decoder.layers.0.self_attention.core_attention._extra_state").

`load_sharded` asks megatron which requested keys the checkpoint lacks (``StrictHandling.RETURN_UNEXPECTED``:
megatron reads the checkpoint's metadata and leaves those keys out of the load). Lacking `_extra_state` objects
are fine: the module keeps its own (the model's `load_state_dict` ignores them too, `grpo_mega.model.gpt`).
Any other lacking key raises ValueError naming it. Checkpoint entries the model does not ask for (a TE
checkpoint's `_extra_state` in a local model) are not read, as in every dist_checkpointing load.
"""

from __future__ import annotations

import logging
import os

from grpo_mega.model.gpt import is_extra_state

logger = logging.getLogger(__name__)


def load_sharded(sharded_state_dict: dict, ckpt_dir: str | os.PathLike) -> dict:
    """``dist_checkpointing.load(sharded_state_dict, ckpt_dir)`` that tolerates `_extra_state` objects missing from
    the checkpoint (module docstring); collective. Returns the loaded state dict, without those entries. Raises
    ValueError naming the folder and the keys when the checkpoint lacks any other requested key."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from grpo_mega.checkpoint import dcp_metadata_compat

    dcp_metadata_compat.apply()  # torch >= 2.15: megatron's metadata reader fails without it
    state, _, lacking = dist_checkpointing.load(sharded_state_dict, str(ckpt_dir),
                                                strict=StrictHandling.RETURN_UNEXPECTED)
    other = sorted(key for key in lacking if not is_extra_state(key))
    if other:
        raise ValueError(f"{ckpt_dir} lacks {len(other)} tensors or objects of this model: {other[:8]}; it was "
                         "saved from a model of another shape or architecture")
    if lacking:
        logger.debug("%s has no %s: those modules keep their own extra state", ckpt_dir, sorted(lacking))
    return state
