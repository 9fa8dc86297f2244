"""torch's fused Adam / AdamW kernel for megatron-core's optimizer where Transformer Engine and apex are absent.

Without TE or apex, megatron-core 0.16 builds ``torch.optim.AdamW`` (``Adam`` without decoupled weight decay) with
neither ``fused`` nor ``foreach`` (megatron/core/optimizer/__init__.py), so torch picks its ``foreach`` kernels on
CUDA: about a dozen multi-tensor launches per step, each reading and writing the parameters, gradients and both
moments again. The fused kernel (``torch._fused_adamw_``) reads each once per step; it computes the same update
(the same formula, fp32, within rounding: tests/test_fused_adam.py). It runs on CUDA (and on the CPU since torch 2.4).

Two things fused Adam needs that megatron does not arrange:

- every ``step`` state tensor on its parameter's device (foreach keeps it on the host). A resumed optimizer's
  ``step`` comes from a checkpoint read onto the CPU (``grpo_mega.engine.distributed_optimizer``), and
  ``load_state_dict`` also brings back the param groups' saved ``fused`` flag (None for a checkpoint written
  without it);
- so a step pre-hook puts both right before every step: a few microseconds per parameter tensor, nothing moved
  after the first step.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def torch_adam_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Adam`` / ``AdamW`` objects inside a megatron optimizer (chained, mixed precision or fp32:
    each keeps its torch optimizer as ``.optimizer``); none with TE's or apex's FusedAdam."""
    found = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(inner)
    return found


def _fused_before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Step pre-hook: every group fused (a loaded state dict may have brought back its saved flag) and every
    ``step`` state tensor an fp32 scalar on its parameter's device (where the fused kernel reads it)."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None and (not torch.is_tensor(step) or step.device != param.device):
                optimizer.state[param]["step"] = torch.as_tensor(step, dtype=torch.float32).to(param.device)


def use_fused_adam(optimizer) -> int:
    """Switch the torch Adam(W) optimizers inside ``optimizer`` to the fused kernel (the same update) and keep them
    there across ``load_state_dict``; returns how many torch optimizers were switched (0 with TE / apex, whose
    FusedAdam is fused already, or when some parameter is on a device without the kernel)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    switched = 0
    for inner in torch_adam_optimizers(optimizer):
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type not in supported or not torch.is_floating_point(p) for p in params):
            continue
        _fused_before_step(inner, (), {})
        inner.register_step_pre_hook(_fused_before_step)
        switched += 1
    return switched


def fused_adam_for_device(optimizer, device: torch.device) -> None:
    """:func:`use_fused_adam` where the kernel runs (CUDA, the CPU), with a log line saying what it did. On this
    project's CPU one AdamW step of the quickstart policy takes 1.1 ms fused against 9.2 ms foreach, of two layers of
    the Qwen2.5-0.5B shape 0.057 s against 0.45 s (bench/results/update_fixed_costs.json)."""
    if torch.device(device).type not in ("cuda", "cpu"):
        return
    if use_fused_adam(optimizer):
        logger.debug("optimizer: torch's fused AdamW kernel on %s (Transformer Engine and apex absent)",
                    torch.device(device).type)
