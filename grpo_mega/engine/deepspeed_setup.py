"""What the DeepSpeed engine needs before it runs: the optional import, its JSON config, the optimizer.

DeepSpeed is an optional extra (``pip install 'grpo-mega[deepspeed]'``); the Megatron path never imports it.
On the CPU, DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, gloo) is selected before the first import.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 600
"""A DeepSpeed op build's lock older than this is taken for one left by a killed build."""

INSTALL_HINT = "pip install 'grpo-mega[deepspeed]' (or pip install deepspeed)"


def import_deepspeed(device: torch.device):
    """The ``deepspeed`` module, its accelerator chosen for ``device`` (``cpu`` sets ``DS_ACCELERATOR=cpu`` unless
    the environment already names one). Raises ImportError with the install command when it is not installed."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warn_stale_build_locks()
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(f"engine=deepspeed needs the deepspeed package, which is not importable ({error}); "
                          f"install it with: {INSTALL_HINT}") from None
    accelerator = deepspeed.get_accelerator().device_name()
    if device.type == "cpu" and accelerator != "cpu":
        raise RuntimeError(f"deepspeed was imported with the {accelerator!r} accelerator, but this process computes "
                           "on the CPU: set DS_ACCELERATOR=cpu before anything imports deepspeed")
    # Per-step INFO lines (config dumps, timers) would drown the trainer's own log.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def warn_stale_build_locks() -> list[Path]:
    """Warn about (and return) DeepSpeed op build locks older than ``STALE_LOCK_SECONDS``.

    DeepSpeed JIT-builds its CPU ops (e.g. ``deepspeed_shm_comm``) into torch's extension folder
    (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a ``lock`` file; a build killed midway
    leaves the lock, and every later DeepSpeed job then waits on it forever without a word. A build takes a minute or
    two, so an older lock is named here with the command that clears it."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time()
    ages = {lock: now - lock.stat().st_mtime for lock in sorted(root.glob("*/deepspeed_*/lock"))}
    stale = [lock for lock, age in ages.items() if age > STALE_LOCK_SECONDS]
    for lock in stale:
        logger.warning("DeepSpeed op build lock %s is %.0f minutes old: a killed build leaves it, and DeepSpeed then "
                       "waits on it forever; if no build is running, remove it (rm %s)", lock, ages[lock] / 60, lock)
    return stale


def deepspeed_config(settings, *, clip_grad: float, device: torch.device, world_size: int, train: bool) -> dict:
    """DeepSpeed's config dict for ``settings`` (``grpo_mega.config.DeepSpeedConfig``).

    The engine owns micro-batching, gradient accumulation boundaries and the learning-rate schedule, so the batch
    sizes here are DeepSpeed's bookkeeping only (1 row, 1 accumulation step per rank). bf16 on a GPU, fp32 on the
    CPU; bf16 checks gradients for NaN / Inf so a non-finite step is skipped as in fp32.
    """
    zero: dict = {"stage": settings.zero_stage}
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if settings.zero_stage == 3:
        # Parameters stay partitioned between calls; no parameter is kept whole across steps.
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # torch's AdamW also for offloaded state: same update as the Megatron engine, no compiled CPU Adam.
        "zero_force_ds_cpu_optimizer": False,
    }
    if train:
        config["gradient_clipping"] = float(clip_grad)
    if device.type == "cuda":
        config["bf16"] = {"enabled": True, "check_grad_overflow": True}
    return config


def cast_parameters(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` moved to ``device`` with its floating-point parameters in ``dtype`` and its buffers left in their
    own dtype, as DeepSpeed casts the training engine's module (deepspeed/runtime/engine.py
    ``_cast_module_mixed_precision``: buffers are cast only with ``buffer_dtype`` set). ``module.to(device, dtype)``
    would also round the rotary ``inv_freq`` buffer to bf16 on a GPU, so a replicated forward-only engine (the KL
    reference at ZeRO-1/2, a PRM) would compute other rotary angles than the policy it is compared with."""
    module.to(device)
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return module


def adamw_param_groups(module: torch.nn.Module) -> list[dict]:
    """Megatron's weight-decay split: no decay (``wd_mult`` 0) on biases and 1-D parameters (norms), decay on the
    rest. ``wd_mult`` is read by the learning-rate schedule (megatron's ``OptimizerParamScheduler``)."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    return [group for group in groups if group["params"]]


def build_adamw(module: torch.nn.Module, optim) -> torch.optim.Optimizer:
    """torch's AdamW over :func:`adamw_param_groups` with ``optim``'s settings (``grpo_mega.config.OptimConfig``),
    the optimizer the Megatron engine falls back to without Apex / Transformer Engine."""
    return torch.optim.AdamW(
        adamw_param_groups(module), lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
        weight_decay=optim.weight_decay,
    )
