"""LoRA on the DeepSpeed engine (``model.lora`` with ``engine: deepspeed``): peft's LoRA layers on the HF model.

``peft.inject_adapter_in_model`` replaces each target ``nn.Linear`` of the backbone (megatron's target names mapped
to Hugging Face's: ``linear_qkv`` -> q_proj, k_proj, v_proj; ``linear_proj`` -> o_proj; ``linear_fc1`` -> gate_proj,
up_proj; ``linear_fc2`` -> down_proj) with a ``peft.tuners.lora.Linear`` computing x W^T + s dropout(x) A^T B^T,
s = alpha / rank, W frozen (``base_layer``), B zero at the start. peft gives q, k and v (gate and up) an A each where
the Megatron engine's fused linears share one: the same function at step 0, more trainable parameters.

What the engine does with them (as the Megatron engine's ``grpo_mega.lora.StageAdapters``):
- every base weight is frozen (``requires_grad`` False), so the optimizer and ZeRO hold the adapters only;
- the KL reference is the base: :meth:`HFAdapters.disabled` switches every adapter off (peft's
  ``enable_adapters(False)``), the model is the frozen base exactly;
- exported weights (sync to the rollout engine, HF folders) are merged, W + s B A, under the HF names
  (``base_layer`` dropped, no ``lora_`` tensor): :func:`merge_peft_adapters`, W gathered with its A and B at ZeRO-3;
- checkpoints hold the adapters alone (``save_checkpoint(exclude_frozen_parameters=True)``; the base comes from
  ``model.init_from`` again on resume).

A is drawn from its own generator per layer (not from the job's random streams: peft's initialisation runs under
``torch.random.fork_rng``), uniform in +-1/sqrt(in_features) as peft's default.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Iterable, Iterator, Mapping

import torch

from grpo_mega.checkpoint.lora_names import HF_TARGET_NAMES

ADAPTER = "default"
"""peft's adapter name (parameters ``...q_proj.lora_A.default.weight``)."""


def hf_target_modules(target_modules) -> list[str]:
    """Hugging Face's linear names of megatron's ``model.lora.target_modules``, in HF_TARGET_NAMES' order."""
    wanted = set(target_modules)
    return [hf for hf, megatron in HF_TARGET_NAMES.items() if megatron in wanted]


def hf_name(name: str) -> str | None:
    """The Hugging Face checkpoint name of a parameter of the adapted model; None for an adapter's own tensor."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


class HFAdapters:
    """peft's LoRA adapters on ``module`` (``engine.hf_policy.HFTokenLogprobModel``), its other weights frozen.

    Args:
        module: the HF log-prob model; adapters go into its backbone ``module.model`` (never the output head).
        lora: ``model.lora`` (rank, alpha, dropout, target_modules by megatron's names).
        seed: seed of the A matrices (one stream per adapted linear, from its name).
        base: the frozen weights' source (``model.init_from``), recorded in checkpoints.
    """

    def __init__(self, module: torch.nn.Module, lora, *, seed: int, base: str | None = None):
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        from grpo_mega.lora.adapter import initial_a

        self.settings = lora
        self.base = base
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=hf_target_modules(lora.target_modules), bias="none")
        module.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):  # peft's init draws from the global stream: leave it untouched
            inject_adapter_in_model(config, module.model)
        self.layers: dict[str, LoraLayer] = {name: layer for name, layer in module.model.named_modules()
                                             if isinstance(layer, LoraLayer)}
        if not self.layers:
            raise ValueError(f"model.lora.target_modules={list(lora.target_modules)}: no such linear layer in "
                             f"{type(module.model).__name__}")
        with torch.no_grad():
            for name, layer in self.layers.items():
                a = layer.lora_A[ADAPTER].weight
                a.copy_(initial_a(lora.rank, a.shape[1], seed * 1_000_003 + zlib.crc32(name.encode())))
        self.scale = lora.alpha / lora.rank

    @contextlib.contextmanager
    def disabled(self):
        """The base model inside the block: every adapter switched off (the KL reference). peft's switch also
        clears the adapters' ``requires_grad``; switching back restores it."""
        for layer in self.layers.values():
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.enable_adapters(True)

    def trainable_parameters(self) -> int:
        """Adapter parameters of the whole model (ZeRO-3 partitions counted whole)."""
        return sum(int(getattr(p, "ds_numel", p.numel())) for layer in self.layers.values()
                   for part in (layer.lora_A, layer.lora_B) for p in part[ADAPTER].parameters())

    def describe(self) -> dict:
        """What a checkpoint's ``grpo_mega_checkpoint.json`` says of the adapters (as the Megatron engine's, plus
        ``format``: peft's layout, so its adapters are not read as megatron's)."""
        s = self.settings
        return {"rank": s.rank, "alpha": s.alpha, "target_modules": list(s.target_modules), "adapters_only": True,
                "base": self.base, "format": "peft"}


def merge_peft_adapters(named: Iterable[tuple[str, torch.Tensor]], scale: float
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) of every weight of ``named`` with its adapter merged in: W + scale B A, computed in
    fp32 and returned in W's dtype, under the HF name (``...q_proj.weight``); every other tensor under its HF name
    (``base_layer`` dropped, :func:`hf_name`); no ``lora_`` tensor.

    ``named``: whole tensors under the peft model's names (``...q_proj.base_layer.weight``,
    ``...q_proj.lora_A.default.weight``, ``...q_proj.lora_B.default.weight``), an A paired with its B and W by the
    linear's name prefix. Streamed: a linear's tensors wait only until the last of its three arrives, so in module
    order (W, then A, then B) at most one W is held. RuntimeError naming the linears left without all three.
    The one merge of peft-layout adapters: the DeepSpeed engine's synced / exported weights (the peft model's
    tensors from ``engine.deepspeed_weights.iter_gathered``: collective at ZeRO-3, every rank iterates to the end)
    and a DeepSpeed LoRA checkpoint read as whole weights (:func:`merged_with_base`); the Megatron engine's fused
    adapters merge in ``grpo_mega.lora``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}  # linear's prefix -> {"W", "A", "B"} received so far
    for name, tensor in named:
        for marker, part in ((".lora_A.", "A"), (".lora_B.", "B"), (".base_layer.weight", "W")):
            if marker in name:
                prefix = name.split(marker)[0]
                held = parts.setdefault(prefix, {})
                held[part] = tensor
                if len(held) == 3:
                    del parts[prefix]
                    weight = held["W"]
                    merged = weight.float() + (held["B"].float() @ held["A"].float()) * scale
                    yield f"{prefix}.weight", merged.to(weight.dtype)
                break
        else:
            yield hf_name(name), tensor
    if parts:
        raise RuntimeError(f"LoRA merge: linears without their weight, A and B: "
                           f"{ {prefix: sorted(held) for prefix, held in list(parts.items())[:4]} }")


def merged_with_base(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scale: float
                     ) -> dict[str, torch.Tensor]:
    """Whole fp32 weights by HF name: ``base`` (HF names) with ``adapters`` (peft names, ``lora_`` tensors; other
    tensors ignored) merged in by :func:`merge_peft_adapters`, each W next to its A and B."""
    factors: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in adapters.items():
        for marker in (".lora_A.", ".lora_B."):
            if marker in name:
                factors.setdefault(f"{name.split(marker)[0]}.weight", []).append((name, tensor))
    unknown = sorted(name for name in factors if name not in base)
    if unknown:
        raise ValueError(f"LoRA adapters of linears the base does not have: {unknown[:4]}")

    def peft_named():
        for name in base.keys():
            if name in factors:
                yield name.removesuffix(".weight") + ".base_layer.weight", base[name].float()
                yield from factors[name]
            else:
                yield name, base[name].float()

    return dict(merge_peft_adapters(peft_named(), scale))
