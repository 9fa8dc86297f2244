"""The libraries' console noise that no user can act on, and the filters that keep it off: installed by the entry
points (``grpo-mega``, ``tools/*``, so every rank under torchrun or srun), by the fork server of local ranks
(``grpo_mega.run.rank_preload``) and by each local rank (``grpo_mega.run.launcher``: spawned ranks import nothing
of the server's), never at import of the package."""

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
LIBRARY_INTERNAL_WARNINGS = (
    # megatron zeroing the gradients of its optimizer's parameter groups (optimizer._zero_grad_group_helper), which
    # hold views of its buffers, not leaf tensors, at DP > 1
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", r"megatron\."),
    # megatron's gradient buffers (distributed.param_and_grad_buffer) call torch's older names of the collectives
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     r"torch\.distributed\.c10d_logger"),
)
"""(category, message regex from the start, module regex of the warning's location) of the warnings every rank of
a data-parallel run printed once per process from inside megatron-core, about calls no user makes."""
RAISED_AFTER_LOGGING = ("megatron.core.dist_checkpointing.strategies.filesystem_async",)
"""Loggers that log an error at ERROR and then hand the same error to their caller, which raises it: megatron's
checkpoint writer (``Local process 1 encountered an error: ...``, one line per rank on a full disk besides the
failure's own line, which names it with its fix; its traceback file keeps the writer's message)."""
QUIET_DEPRECATIONS_OF = ("megatron", "torch.distributed.checkpoint", "torch.distributed._shard", "transformers")
"""Libraries whose deprecation notices concern their own internals (not a user's code or config)."""


def quiet_libraries() -> None:
    """Keep the console for our progress and warnings that matter: megatron logs every parameter name at INFO, and
    megatron / torch.distributed.checkpoint repeat deprecation and "no Apex / Transformer Engine" warnings in every
    process."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for name in RAISED_AFTER_LOGGING:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for message in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for category, message, module in LIBRARY_INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for module in QUIET_DEPRECATIONS_OF:
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
