"""LoRA on one pipeline stage of the policy: adapters attached to the target linears of its transformer layers.

:func:`attach_lora` freezes every weight of the stage, builds one :class:`~grpo_mega.lora.adapter.LoRAAdapter` per
target linear and adds its output to the linear's through a forward hook, so the megatron modules, their names and
their checkpoint / HF tables stay as they are. The adapters live in the stage's submodule ``lora_adapters``, so
megatron's DDP (gradient buffers for parameters that require gradients only) and optimizer (param groups of those
parameters only) hold them and nothing else. The base's own sharded state never lists them; checkpoints of a LoRA
run hold the adapters alone (:meth:`StageAdapters.sharded_state_dict`), under global keys
(``lora.decoder.layers.<global layer>.self_attention.linear_qkv.A``) that reshard to any TP / PP. A stage's
``trained_modules`` (a PRM's classifier head: new weights, no base to adapt) stay fully trained and are saved
with the adapters, under the whole model's keys (``head.score.0.weight``).
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from grpo_mega.lora.adapter import LoRAAdapter

ADAPTERS_MODULE = "lora_adapters"
"""Name of the stage's submodule that holds the adapters (its parameters: ``lora_adapters.<key>.A`` / ``.B``)."""

_TARGET_PARENTS = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
                   "linear_fc1": "mlp", "linear_fc2": "mlp"}


class _AdapterModules(torch.nn.ModuleDict):
    """The stage's adapters. Not part of the base model's sharded state (megatron asks each submodule for its
    own): a whole-model checkpoint or HF folder loads into the base, the adapters have their own state."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return {}


class StageAdapters:
    """The adapters of one stage and what the engine does with them: switch them off (the KL reference is the
    base), merge them into exported weights, save and load them alone."""

    def __init__(self, stage: torch.nn.Module, lora, *, seed: int, base: str | None = None, attach: bool = True,
                 trained_modules: tuple[str, ...] = ()):
        """``attach`` False: the adapters are built (to read a checkpoint's into and merge them, ``merge_into_base``)
        but the stage is left as it is: no hook, no submodule, nothing frozen. ``trained_modules``: names of the
        stage's submodules that stay trainable and are saved with the adapters (those this stage has)."""
        self.settings = lora
        self.base = base
        self.trained_modules = tuple(trained_modules)
        self._trained = {name: getattr(stage, name) for name in self.trained_modules
                         if getattr(stage, name, None) is not None}
        self.enabled = True
        self.modules = _AdapterModules()
        self._by_weight: dict[int, LoRAAdapter] = {}
        self._bases: dict[str, torch.nn.Module] = {}
        self._keys: dict[str, tuple[str, LoRAAdapter, bool]] = {}  # checkpoint key prefix -> (kind, adapter, glu)
        if attach:
            stage.requires_grad_(False)
            for module in self._trained.values():
                module.requires_grad_(True)
        gated = bool(getattr(stage.config, "gated_linear_unit", False))
        for layer in getattr(getattr(stage, "decoder", None), "layers", []):
            index = layer.layer_number - 1  # global: the same adapter names at any PP layout
            for target in lora.target_modules:
                parent = getattr(layer, _TARGET_PARENTS[target])
                base_linear = getattr(parent, target, None)
                if base_linear is None:  # a mixture-of-experts MLP has no linear_fc1 / fc2 of its own
                    raise ValueError(f"model.lora.target_modules: layer {index} has no {_TARGET_PARENTS[target]}."
                                     f"{target} (a mixture-of-experts MLP): adapt linear_qkv and linear_proj only")
                key = f"layer{index}_{target}"
                adapter = LoRAAdapter(base_linear, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                      seed=seed * 1_000_003 + zlib.crc32(key.encode()))
                self.modules[key] = adapter
                self._by_weight[id(base_linear.weight)] = adapter
                name = f"lora.decoder.layers.{index}.{_TARGET_PARENTS[target]}.{target}"
                self._keys[name] = (target, adapter, gated and target == "linear_fc1")
                self._bases[key] = base_linear
                if attach:
                    base_linear.register_forward_hook(self._hook(adapter))
        if attach:
            stage.add_module(ADAPTERS_MODULE, self.modules)
            # Whole-model state dicts (an HF folder, a full checkpoint) load into the base without the adapters.
            stage.register_load_state_dict_post_hook(_ignore_missing_adapters)

    def _hook(self, adapter: LoRAAdapter):
        def add_adapter_output(module, args, output):
            if not self.enabled:
                return output
            out, bias = output
            return out + adapter(args[0]).to(out.dtype), bias

        return add_adapter_output

    # ----------------------------------------------------------------- the base alone
    @contextlib.contextmanager
    def disabled(self):
        """The base model inside the block: every adapter's output left out (the KL reference)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    # ----------------------------------------------------------------- merged weights
    def adapter_of(self, weight: torch.Tensor) -> LoRAAdapter | None:
        """The adapter of the base linear whose weight is ``weight`` (this rank's shard), None when it has none."""
        return self._by_weight.get(id(weight))

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``weight`` with its adapter merged in, W + s B A (computed in fp32, returned in W's
        dtype, a new tensor); any other tensor as it is."""
        adapter = self._by_weight.get(id(weight))
        if adapter is None:
            return weight
        return (weight.detach().float() + adapter.delta()).to(weight.dtype)

    @torch.no_grad()
    def merge_into_base(self) -> None:
        """W <- W + s B A in every adapted linear, in place (a LoRA checkpoint read as whole weights)."""
        for key, adapter in self.modules.items():
            weight = self._bases[key].weight
            weight.copy_(self.merged(weight))

    # ----------------------------------------------------------------- counts
    def local_parameters(self) -> int:
        """Adapter parameters held on this rank."""
        return sum(p.numel() for p in self.modules.parameters())

    def trainable_parameters(self) -> int:
        """Trained parameters of the whole model (adapters and ``trained_modules``; every stage, whole tensors);
        collective over the PP group."""
        total = 0
        for kind, adapter, _ in self._keys.values():
            sharded = adapter.B if kind in ("linear_qkv", "linear_fc1") else adapter.A
            whole = adapter.A if sharded is adapter.B else adapter.B
            total += whole.numel() + sharded.numel() * mpu.get_tensor_model_parallel_world_size()
        total += sum(p.numel() for module in self._trained.values() for p in module.parameters())  # replicated
        count = torch.tensor([float(total)], dtype=torch.float64)
        if dist.is_initialized() and mpu.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(count, group=mpu.get_pipeline_model_parallel_group())
        return int(count.item())

    # ----------------------------------------------------------------- checkpoints: the adapters alone
    def sharded_state_dict(self) -> dict:
        """megatron ShardedTensors of the adapters (global shapes, loadable at any TP / PP); the tensors are the
        parameters themselves, so the optimizer's sharded state maps onto them."""
        state = {}
        for name, (kind, adapter, glu) in self._keys.items():
            if adapter.kind == "column":
                state[f"{name}.A"] = make_sharded_tensor_for_checkpoint(adapter.A, f"{name}.A")
                b = make_tp_sharded_tensor_for_checkpoint(adapter.B, f"{name}.B", tp_axis=0)
                # a gated MLP's rank holds [gate_t; up_t]: the two halves are sharded separately, as megatron does
                state[f"{name}.B"] = apply_swiglu_sharded_factory(b, ()) if glu else b
            else:
                state[f"{name}.A"] = make_tp_sharded_tensor_for_checkpoint(adapter.A, f"{name}.A", tp_axis=1)
                state[f"{name}.B"] = make_sharded_tensor_for_checkpoint(adapter.B, f"{name}.B")
        for name, module in self._trained.items():  # as the whole model's sharded state has them
            state.update(sharded_state_dict_default(module, f"{name}."))
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy loaded adapter tensors (``dist_checkpointing.load`` of :meth:`sharded_state_dict`) into the
        adapters; ValueError naming the keys when they do not match."""
        wanted = {f"{name}.{part}": getattr(adapter, part)
                  for name, (_, adapter, _) in self._keys.items() for part in ("A", "B")}
        wanted.update({f"{name}.{key}": tensor for name, module in self._trained.items()
                       for key, tensor in module.state_dict(keep_vars=True).items()})
        missing, unexpected = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
        if missing or unexpected:
            raise ValueError(f"LoRA adapter state: missing {missing[:6]}, unexpected {unexpected[:6]} (model.lora "
                             "must match the checkpoint's rank and target_modules)")
        for key, param in wanted.items():
            value = state[key]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"LoRA adapter {key}: shape {tuple(value.shape)} in the checkpoint, "
                                 f"{tuple(param.shape)} here (model.lora.rank differs?)")
            param.copy_(value)

    def describe(self) -> dict:
        """What a checkpoint's ``grpo_mega_checkpoint.json`` says of the adapters: their settings and the base."""
        s = self.settings
        trained = {"trained_modules": list(self.trained_modules)} if self.trained_modules else {}
        return {"rank": s.rank, "alpha": s.alpha, "target_modules": list(s.target_modules), "adapters_only": True,
                "base": self.base, **trained}


def _ignore_missing_adapters(module, incompatible_keys) -> None:
    prefix = f"{ADAPTERS_MODULE}."
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not k.startswith(prefix)]


def attach_lora(stage: torch.nn.Module, lora, *, seed: int, base: str | None = None,
                trained_modules: tuple[str, ...] = ()) -> StageAdapters | None:
    """Attach ``model.lora``'s adapters to ``stage`` (freezing its weights but ``trained_modules``) when
    ``lora.rank`` > 0; None when off. ``seed`` draws the adapters' A (the same at every layout); ``base`` names the
    frozen weights' source."""
    if lora is None or not lora.enabled:
        return None
    return StageAdapters(stage, lora, seed=seed, base=base, trained_modules=trained_modules)
