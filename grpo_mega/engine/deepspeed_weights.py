"""Moving whole weights in and out of the DeepSpeed engines: bucketed ZeRO-3 gathers, HF-named loads, and
Megatron-format weights (a converted megatron folder or a Megatron training checkpoint) through a CPU copy.

ZeRO-3 keeps each parameter partitioned over the ranks: rank r holds elements [r * P, (r + 1) * P) of the flattened
parameter (P = ceil(numel / world), the last partition zero-padded) in ``param.ds_tensor``. Whole weights are
read in buckets of about ``bucket_bytes``: the local partitions of a bucket's parameters are concatenated and
gathered with ONE ``all_gather_into_tensor``, then cut back into parameters; at most one bucket is whole at a
time. (DeepSpeed's ``GatheredParameters`` issues one all-gather per parameter, the per-tensor cost OpenRLHF's
weight sync is known for.) Loading needs no communication: every rank has the full tensors and writes its slice.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.distributed as dist

TIED_OUTPUT = "lm_head.weight"


def _is_partitioned(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")  # a ZeRO-3 parameter


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The whole parameter's shape (``ds_shape`` of a partitioned ZeRO-3 parameter)."""
    return tuple(param.ds_shape) if _is_partitioned(param) else tuple(param.shape)


def _buckets(named_params, bucket_bytes: int) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters of one dtype, at most ``bucket_bytes`` whole (a larger parameter alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"deepspeed.gather_bucket_mb must give at least 1 byte, got {bucket_bytes}")
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    filled = 0
    for name, param in named_params:
        size = (param.ds_numel if _is_partitioned(param) else param.numel()) * param.element_size()
        if bucket and (filled + size > bucket_bytes or param.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, param))
        filled += size
    if bucket:
        yield bucket


def _gather_partitioned(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Whole copies of ZeRO-3 parameters (one dtype) with one all-gather over all ranks; collective."""
    sizes = [param.ds_tensor.ds_numel for param in params]  # the same on every rank
    local = torch.cat([param.ds_tensor.reshape(-1)[:size] for param, size in zip(params, sizes)])
    gathered = torch.empty(dist.get_world_size() * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local)
    per_rank = gathered.view(dist.get_world_size(), -1)
    whole, offset = [], 0
    for param, size in zip(params, sizes):
        flat = per_rank[:, offset : offset + size].reshape(-1)[: param.ds_numel]
        whole.append(flat.view(param.ds_shape).clone())
        offset += size
    return whole


def iter_full_weights(engine, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) of every parameter of ``engine``, each a new tensor; collective at ZeRO-3 (every rank
    iterates to the end: one all-gather per bucket), no communication for replicated parameters. With LoRA the
    base weights with the adapters merged in (``engine.deepspeed_lora.merge_peft_adapters``)."""
    if getattr(engine, "lora", None) is not None:
        from grpo_mega.engine.deepspeed_lora import merge_peft_adapters

        return merge_peft_adapters(iter_gathered(engine.module.named_parameters(), bucket_bytes), engine.lora.scale)
    return iter_gathered(engine.named_parameters(), bucket_bytes)


def iter_gathered(named_params, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of each of ``named_params`` in order, each a new tensor (see ``iter_full_weights``)."""
    for bucket in _buckets(named_params, bucket_bytes):
        partitioned = [param for _, param in bucket if _is_partitioned(param)]
        whole = iter(_gather_partitioned(partitioned)) if partitioned else iter(())
        for name, param in bucket:
            yield name, (next(whole) if _is_partitioned(param) else param.detach().clone())


def _write_partition(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Write this rank's slice of ``full`` into a ZeRO-3 parameter's partition (padding zeroed)."""
    size = param.ds_tensor.ds_numel
    start = dist.get_rank() * size
    piece = full.reshape(-1)[start : start + size]
    partition = param.ds_tensor.data.view(-1)
    partition[: piece.numel()].copy_(piece)
    partition[piece.numel() :].zero_()


def load_named_weights(engine, weights: Mapping[str, torch.Tensor], *, optional_prefixes: tuple[str, ...] = ()) -> None:
    """Copy HF-named full tensors into the engine's parameters (ZeRO-3: each rank writes its partition; no
    communication). Every rank must pass the same tensors.

    Raises ValueError naming the tensors the model needs and ``weights`` lacks (except parameters whose names start
    with one of ``optional_prefixes``, which keep their values when absent), names the model does not have (a tied
    ``lm_head.weight`` next to the embedding is accepted), and shape mismatches. The caller refreshes what derives
    from the weights (``reload_after_weight_load``)."""
    params = {name: param for name, param in engine.named_parameters()
              if name in weights or not name.startswith(optional_prefixes)}
    tied = bool(getattr(engine.hf_config, "tie_word_embeddings", False))
    missing = sorted(name for name in params if name not in weights)
    unknown = sorted(name for name in weights if name not in params and not (tied and name == TIED_OUTPUT))
    if missing or unknown:
        raise ValueError(f"the weights do not fit the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"not in the model {unknown[:8]}{'...' if len(unknown) > 8 else ''}")
    for name, param in params.items():
        shape = tuple(weights.shape_of(name)) if hasattr(weights, "shape_of") else tuple(weights[name].shape)
        if shape != full_shape(param):
            raise ValueError(f"weight {name!r} has shape {shape}, the model's is {full_shape(param)}")
    with torch.no_grad():
        for name, param in params.items():
            tensor = weights[name]
            if _is_partitioned(param):
                _write_partition(param, tensor.to(param.ds_tensor.device, param.dtype))
            else:
                param.data.copy_(tensor.to(param.device, param.dtype))


class MegatronShadow:
    """A CPU megatron-core model of ``hf_config`` at TP = PP = 1, to read Megatron-format weights as HF-named tensors
    (megatron's parallel state must be initialised, as ``init_distributed(1, 1)`` does). ``build_stage(hf_config,
    gpt_config)`` builds it (a PRM with its head: ``prm.engines.build_conversion_stage``); None: a GPT with LM output."""

    def __init__(self, hf_config, build_stage=None):
        from grpo_mega.model import build_gpt_model, gpt_config_from_hf

        self.hf_config = hf_config
        gpt_config = gpt_config_from_hf(hf_config, tp=1, pp=1, dtype=torch.float32)
        self.model = build_gpt_model(gpt_config) if build_stage is None else build_stage(hf_config, gpt_config)

    def sharded_state_dict(self) -> dict:
        """The model's ShardedStateDict, for ``dist_checkpointing.load``."""
        return self.model.sharded_state_dict()

    def hf_weights(self, state: dict | None = None) -> dict[str, torch.Tensor]:
        """Every HF-named tensor of the model, after loading ``state`` (a loaded ``sharded_state_dict()``) if given."""
        from grpo_mega.checkpoint.hf_convert import export_hf_weights

        if state is not None:
            self.model.load_state_dict(state)
        return dict(export_hf_weights(self.model, self.hf_config))


def megatron_weights_as_hf(hf_config, *, directory: str, build_stage=None) -> dict[str, torch.Tensor]:
    """The weights of a converted megatron model folder (``save_mcore_checkpoint``) as HF-named tensors
    (``build_stage`` as in :class:`MegatronShadow`)."""
    from grpo_mega.checkpoint.mcore_checkpoint import load_mcore_checkpoint

    shadow = MegatronShadow(hf_config, build_stage)
    load_mcore_checkpoint(shadow.model, directory)
    return shadow.hf_weights()
