"""Checkpoints: where model weights come from (`source`), HF <-> megatron-core conversion (tables, TP/PP sharding,
export), model and training checkpoints.

It may import ``model`` (the GPT model and its config map), ``parallel`` (process groups) and ``run`` (the run
folder's names, failure records); the engines, the harness, the trainers and the tools import it, never the
other way.
"""

from grpo_mega.checkpoint.hf_compare import compare_logits, mcore_logits
from grpo_mega.checkpoint.hf_convert import (
    check_hf_weights,
    export_hf_weights,
    hf_to_mcore_shards,
    load_hf_weights,
    mcore_shards_to_hf,
)
from grpo_mega.checkpoint.hf_io import HFWeights, SafetensorsShardWriter, copy_side_files
from grpo_mega.checkpoint.hf_layouts import ARCHITECTURES, architecture_for
from grpo_mega.checkpoint.mcore_checkpoint import (
    load_mcore_checkpoint,
    read_checkpoint_info,
    save_mcore_checkpoint,
)

__all__ = [
    "ARCHITECTURES",
    "HFWeights",
    "SafetensorsShardWriter",
    "architecture_for",
    "check_hf_weights",
    "compare_logits",
    "copy_side_files",
    "export_hf_weights",
    "hf_to_mcore_shards",
    "load_hf_weights",
    "load_mcore_checkpoint",
    "mcore_logits",
    "mcore_shards_to_hf",
    "read_checkpoint_info",
    "save_mcore_checkpoint",
]
