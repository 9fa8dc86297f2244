"""LoRA on the Megatron engine (``model.lora``): adapters on megatron-core's tensor-parallel linears, sharded as
they are (``adapter``), attached to a pipeline stage with the base frozen (``stage``), and the KL reference as the
base with the adapters off (``reference``). It may import megatron-core and torch only (it sits beside the model
it adapts, below the checkpoints: a LoRA checkpoint read as whole weights is ``grpo_mega.engine.source_weights``'s).

Megatron-Bridge's PEFT (``megatron.bridge.peft.lora``) was the first choice and cannot be installed beside this
package: its releases with megatron-core 0.16 (0.3.x) pin transformers < 5 and require Transformer Engine (CUDA
only) and mamba-ssm; 0.4-0.6.2 need Python 3.12 and pin transformers <= 5.12.1, and its ``lora_layers`` imports
``transformer_engine.pytorch`` at import time (no CPU build). This is the smallest wrapper in its API's shape:
``target_modules`` (its names), ``rank`` (its ``dim``), ``alpha``, ``dropout`` (position ``pre``), A random and B
zero at the start, adapters saved alone and merged for export."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_mega.lora.adapter import LoRAAdapter
from grpo_mega.lora.reference import AdaptersOffReference
from grpo_mega.lora.stage import ADAPTERS_MODULE, StageAdapters, attach_lora


@dataclasses.dataclass(frozen=True)
class LoRAAttacher:
    """``model.lora`` and how to attach it: called on a megatron stage it attaches the adapters (``attach_lora``);
    the DeepSpeed engine reads ``lora``, ``seed`` and ``base`` to put peft's adapters on its HF model instead
    (``grpo_mega.engine.deepspeed_lora``)."""

    lora: Any
    seed: int
    base: str | None = None
    trained_modules: tuple[str, ...] = ()

    def __call__(self, stage) -> StageAdapters | None:
        return attach_lora(stage, self.lora, seed=self.seed, base=self.base, trained_modules=self.trained_modules)


def lora_attacher(lora, *, seed: int, base: str | None = None,
                  trained_modules: tuple[str, ...] = ()) -> LoRAAttacher | None:
    """``stage -> StageAdapters`` for ``MegatronEngine(attach_adapters=...)`` when ``lora.rank`` > 0, else None.
    ``trained_modules``: submodules of the stage trained whole beside the adapters (a PRM's classifier head)."""
    if lora is None or not lora.enabled:
        return None
    return LoRAAttacher(lora, seed, base, tuple(trained_modules))


__all__ = ["ADAPTERS_MODULE", "AdaptersOffReference", "LoRAAdapter", "LoRAAttacher", "StageAdapters", "attach_lora",
           "lora_attacher"]
