"""Checkpoints: where model weights come from (`source`), HF <-> megatron-core conversion (tables, TP/PP sharding,
export), model and training checkpoints.

It may import ``model`` (the GPT model and its config map), ``parallel`` (process groups) and ``run`` (the run
folder's names, failure records); the engines, the harness, the trainers and the tools import it, never the
other way.

The names below load their module on first use (PEP 562): the torch-free modules of this package
(``training_files``: what a checkpoint folder holds, which weights a folder has) are read by the checks a command
makes before it launches its ranks, without torch's and megatron-core's import (5-7 s on the 2-core test machine).
"""

import importlib

_MODULE_OF = {
    "ARCHITECTURES": "hf_layouts",
    "HFWeights": "hf_io",
    "SafetensorsShardWriter": "hf_io",
    "architecture_for": "hf_layouts",
    "check_hf_weights": "hf_convert",
    "compare_logits": "hf_compare",
    "copy_side_files": "hf_io",
    "export_hf_weights": "hf_convert",
    "hf_to_mcore_shards": "hf_convert",
    "load_hf_weights": "hf_convert",
    "load_mcore_checkpoint": "mcore_checkpoint",
    "mcore_logits": "hf_compare",
    "mcore_shards_to_hf": "hf_convert",
    "read_checkpoint_info": "mcore_checkpoint",
    "save_mcore_checkpoint": "mcore_checkpoint",
}
"""Each public name and the module of this package that defines it."""

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
