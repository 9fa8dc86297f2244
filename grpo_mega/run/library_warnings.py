"""The libraries' console noise that no user can act on, and the filters that keep it off: installed by the entry
points (``grpo-mega``, ``tools/*``) and by the fork server of local ranks (``grpo_mega.run.rank_preload``), never at
import of the package."""

from __future__ import annotations

import logging
import warnings

KNOWN_HARMLESS_WARNINGS = (
    # megatron-core at import: it runs on torch's own kernels when Apex / Transformer Engine are absent (as on CPU)
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    # megatron's TransformerConfig default for CUDA graphs, which grpo-mega does not use
    r"full scope is deprecated",
)
# Not filtered: megatron's CUDA_DEVICE_MAX_CONNECTIONS warning (init_distributed sets the variable at TP > 1, so it
# shows only where a user set another value, which costs the TP layers their communication overlap).
"""Messages (regexes from the start) of the UserWarnings every run printed once per process and import, none of
which a user can act on. Other warnings of these libraries still show."""
QUIET_DEPRECATIONS_OF = ("megatron", "torch.distributed.checkpoint", "torch.distributed._shard", "transformers")
"""Libraries whose deprecation notices concern their own internals (not a user's code or config)."""


def quiet_libraries() -> None:
    """Keep the console for our progress and warnings that matter: megatron logs every parameter name at INFO, and
    megatron / torch.distributed.checkpoint repeat deprecation and "no Apex / Transformer Engine" warnings in every
    process."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for message in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for module in QUIET_DEPRECATIONS_OF:
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
