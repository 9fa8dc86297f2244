"""Training and forward-only engines on DeepSpeed ZeRO (stage 1, 2 or 3) over Hugging Face causal LMs.

The same interface as the Megatron engine (``grpo_mega.engine.base``), so the GRPO trainer, PRM training, their
checkpoints and weight sync run unchanged (``engine: deepspeed`` in the config). The model is any module whose
``forward(input_ids)`` returns per-token outputs [B, S] named by its ``output_names`` in the engines' alignment: the
policy's ``grpo_mega.engine.hf_policy.HFTokenLogprobModel``, or a PRM's ``prm.hf_model`` modules. Parallelism is data-parallel only: ZeRO shards
optimizer state (1), gradients (2) and parameters (3) over all ranks; ``parallel.tensor`` and ``parallel.pipeline``
must be 1 (megatron's parallel state is still set up, at TP = PP = 1, for the shared log-prob function).

What matches the Megatron engine, so that a step gives the same loss and parameters from the same weights:
- rows are dealt to ranks and cut into token-budget micro-batches by the same functions (``engine.batching``),
  and the loss scale, micro-batch records and metric reduction are the same (``engine.step_records``);
  every rank runs as many micro-batches as the busiest one (padding micro-batches add exactly zero), because
  ZeRO-2/3 reduce gradients, and ZeRO-3 gathers parameters, in every forward / backward;
- loss functions return shares of the global batch (``LossScale``): DeepSpeed averages gradients over ranks,
  so each share is multiplied by the number of ranks; the accumulation boundary is set by the engine;
- AdamW with megatron's weight-decay split, clipping by the global norm, and megatron's learning-rate schedule
  counted in trainer steps.

A non-finite step: ZeRO's step skips an update whose gradient norm is NaN / Inf and zeroes the gradients; a
micro-batch whose loss is not finite has its gradient poisoned with NaN so that the same check skips it. Either
way :class:`~grpo_mega.engine.base.NonFiniteError` is raised on every rank with nothing applied.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from grpo_mega.engine.base import LossFn, NonFiniteError
from grpo_mega.engine.batching import is_padding, padding_micro_batch, rank_micro_batches
from grpo_mega.engine.deepspeed_setup import build_adamw, cast_parameters, deepspeed_config, import_deepspeed
from grpo_mega.engine.lr_schedule import build_lr_schedule, restore_lr_schedule
from grpo_mega.engine.step_records import (
    finish_step_metrics,
    global_loss_scale,
    micro_batch_record,
    reduce_step_records,
)
from grpo_mega.parallel import get_device


class DeepSpeedForwardEngine:
    """Forward-only engine (the KL reference, a PRM at scoring time): a replicated HF model in eval mode without
    gradients, or with ZeRO-3 a DeepSpeed engine without optimizer whose parameters stay partitioned.

    Args:
        module: the model, built in fp32 on every rank from the same seed (``init_distributed`` seeds all ranks
            alike), its parameters under their Hugging Face names; ``module.output_names`` names its outputs.
        hf_config: the transformers config of the model.
        settings: ``grpo_mega.config.DeepSpeedConfig`` (zero_stage, offload_optimizer, gather_bucket_mb).
        max_tokens_per_micro_batch: token budget of a micro-batch (rows x padded length).
        megatron_stage: ``build(hf_config, gpt_config)`` of the megatron model of ``hf_config`` (TP = PP = 1), to
            read Megatron-format weights (``engine.deepspeed_weights.MegatronShadow``); None: a GPT with LM output.
    """

    engine_name = "deepspeed"
    lora = None
    """``engine.deepspeed_lora.HFAdapters`` of a policy trained with LoRA (``model.lora``), else None."""

    def __init__(self, module: torch.nn.Module, *, hf_config, settings, max_tokens_per_micro_batch: int,
                 megatron_stage: Callable | None = None):
        self._setup(module, hf_config, settings, max_tokens_per_micro_batch, megatron_stage)
        self.module.requires_grad_(False)
        if self.zero_stage == 3:
            config = deepspeed_config(settings, clip_grad=0.0, device=self.device, world_size=self.world_size,
                                      train=False)
            self.ds, *_ = self.deepspeed.initialize(model=self.module, config=config)
        else:
            self.ds = cast_parameters(self.module, self.device, self._dtype)
        self.ds.eval()

    def _setup(self, module, hf_config, settings, budget, megatron_stage) -> None:
        if settings.zero_stage not in (1, 2, 3):
            raise ValueError(f"deepspeed.zero_stage={settings.zero_stage}: expected 1, 2 or 3")
        self.device = get_device()
        self.deepspeed = import_deepspeed(self.device)
        self.hf_config = hf_config
        self.zero_stage = settings.zero_stage
        self.gather_bucket_bytes = int(settings.gather_bucket_mb * 2**20)
        self.max_tokens_per_micro_batch = budget
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        if self.world_size == 1:  # a one-process run (grpo-mega train --nproc 1) has no launcher to set it
            os.environ.setdefault("LOCAL_RANK", "0")
        self.last_padding_fraction = 0.0
        self._dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # DeepSpeed casts the fp32 module to bf16 on a GPU and partitions it (ZeRO-3).
        self.module = module
        self.output_names = tuple(module.output_names)
        self.megatron_stage = megatron_stage

    # ----------------------------------------------------------------- micro-batches of this rank
    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches, padded with padding micro-batches to the count of the busiest rank."""
        micro_batches, self.last_padding_fraction = rank_micro_batches(
            batch, self.max_tokens_per_micro_batch, self.rank, self.world_size)
        count = torch.tensor([len(micro_batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(micro_batches) < int(count):
            micro_batches.append(padding_micro_batch(batch, batch["attention_mask"].sum(dim=1)))
        return [{k: v.to(self.device) for k, v in micro.items()} for micro in micro_batches]

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor], loss_tokens_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's outputs {name: [B, L]} of the whole batch, the same on every rank (no gradient); every token's,
        also with ``loss_tokens_only`` (a superset of what it asks for: the HF head computes the whole row)."""
        self.ds.eval()
        rows, length = batch["input_ids"].shape
        outputs = {name: torch.zeros(rows, length, dtype=torch.float32, device=self.device)
                   for name in self.output_names}
        for micro in self._micro_batches(batch):
            head_out = self.ds(micro["input_ids"])
            if not is_padding(micro):
                for name in self.output_names:
                    value = head_out[name].float()
                    outputs[name][micro["row_index"], : value.shape[1]] = value
        for value in outputs.values():  # each row was computed on one rank; zeros elsewhere
            dist.all_reduce(value)
        return {name: value.cpu() for name, value in outputs.items()}

    def forward_logprobs(self, batch: dict[str, torch.Tensor],
                         loss_tokens_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [B, L] of ``input_ids`` (every token's, also with ``loss_tokens_only``)."""
        outputs = self.forward(batch)
        return outputs["logprobs"], outputs["entropy"]

    # ----------------------------------------------------------------- weights
    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the model parameters (bf16 on GPU, fp32 on CPU)."""
        return next(self.module.parameters()).dtype

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters under their Hugging Face names (tied weights once, as HF checkpoints store them);
        with LoRA the base's only (peft's ``base_layer`` left out of the names, the adapters not listed)."""
        if self.lora is None:
            return list(self.module.named_parameters())
        from grpo_mega.engine.deepspeed_lora import hf_name

        return [(hf_name(name), param) for name, param in self.module.named_parameters() if hf_name(name)]

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time, each a new tensor; collective (every rank iterates to the end).
        ZeRO-3 parameters are gathered ``deepspeed.gather_bucket_mb`` at a time, one all-gather per bucket
        (``engine.deepspeed_weights``); at stages 1-2 every rank holds whole parameters and nothing is sent."""
        from grpo_mega.engine.deepspeed_weights import iter_full_weights

        return iter_full_weights(self, self.gather_bucket_bytes)

    def load_hf_weights(self, hf_weights) -> None:
        """Copy HF-named full tensors (a mapping) into the model; collective. ValueError naming missing, unknown
        or misshapen tensors."""
        from grpo_mega.engine.deepspeed_weights import load_named_weights

        load_named_weights(self, hf_weights)
        self.reload_after_weight_load()

    def load_mcore_model(self, directory: str) -> None:
        """Load a converted megatron model folder (``save_mcore_checkpoint``); collective."""
        from grpo_mega.engine.deepspeed_weights import megatron_weights_as_hf

        self.load_hf_weights(megatron_weights_as_hf(self.hf_config, directory=directory,
                                                     build_stage=self.megatron_stage))

    def load_model_source(self, source) -> None:
        """Load the weights of ``source`` (a ``grpo_mega.checkpoint.source.ModelSource``: HF folder, converted
        folder, training checkpoint of either engine); collective (``grpo_mega.engine.source_weights``)."""
        from grpo_mega.engine.source_weights import load_source_weights

        load_source_weights(self, source)

    def model_sharded_state_dict(self) -> dict:
        """The megatron ShardedStateDict of a CPU megatron copy of this model (TP = PP = 1), so a Megatron training
        checkpoint loads into this engine (``init_from``): ``load_model_state_dict`` copies it in through HF names."""
        from grpo_mega.engine.deepspeed_weights import MegatronShadow

        self._shadow = MegatronShadow(self.hf_config, build_stage=self.megatron_stage)
        return self._shadow.sharded_state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Copy a loaded ``model_sharded_state_dict()`` into the model (converted to HF names)."""
        shadow, self._shadow = getattr(self, "_shadow", None), None
        if shadow is None:
            raise RuntimeError("load_model_state_dict needs the state of this engine's model_sharded_state_dict()")
        from grpo_mega.engine.deepspeed_weights import load_named_weights

        load_named_weights(self, shadow.hf_weights(state))

    def reload_after_weight_load(self) -> None:
        """Nothing derives from the weights of a forward-only engine."""


class DeepSpeedEngine(DeepSpeedForwardEngine):
    """DeepSpeed ZeRO training engine behind :class:`~grpo_mega.engine.base.TrainingEngine`.

    Args: as :class:`DeepSpeedForwardEngine`, plus ``optim`` (``grpo_mega.config.OptimConfig``),
    ``total_steps`` (the learning-rate schedule's length in trainer steps) and ``lora``
    (``grpo_mega.lora.LoRAAttacher`` of ``model.lora``, or None): peft's adapters on the model, everything else
    frozen (``engine.deepspeed_lora``).
    """

    def __init__(self, module: torch.nn.Module, *, hf_config, settings, optim, total_steps: int,
                 max_tokens_per_micro_batch: int, megatron_stage: Callable | None = None, lora=None):
        self._setup(module, hf_config, settings, max_tokens_per_micro_batch, megatron_stage)
        if lora is not None:  # before the optimizer: it and ZeRO hold the trainable (adapter) parameters only
            from grpo_mega.engine.deepspeed_lora import HFAdapters

            self.lora = HFAdapters(self.module, lora.lora, seed=lora.seed, base=lora.base)
        self.clip_grad = optim.clip_grad
        self.optimizer = build_adamw(self.module, optim)
        config = deepspeed_config(settings, clip_grad=optim.clip_grad, device=self.device,
                                  world_size=self.world_size, train=True)
        self.ds, *_ = self.deepspeed.initialize(model=self.module, optimizer=self.optimizer, config=config)
        # megatron's schedule over the torch optimizer that ZeRO steps: the same lr / wd at every trainer step.
        self.scheduler = build_lr_schedule(self.optimizer, optim, total_steps)
        self.steps_done = 0

    # ----------------------------------------------------------------- training
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` with ``loss_fn`` at the current learning rate; metrics are summed
        over micro-batches and ranks. Raises NonFiniteError (nothing applied) for a NaN / Inf loss or grad norm."""
        self.ds.train()
        start = time.perf_counter()
        scale = global_loss_scale(batch)
        micro_batches = self._micro_batches(batch)
        records = []
        for index, micro in enumerate(micro_batches):
            self.ds.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
            outputs = self.ds(micro["input_ids"])
            touch_all = sum(value.sum() for value in outputs.values())
            if is_padding(micro):
                target = touch_all * 0.0  # exactly zero gradient, but every parameter takes part (ZeRO hooks)
            else:
                loss, metrics = loss_fn(outputs, micro, scale)
                record = micro_batch_record(loss, metrics)
                records.append(record)
                # DeepSpeed averages gradients over ranks; loss_fn returns shares of the global loss.
                target = loss * self.world_size
                if not math.isfinite(record["loss"]):
                    target = target + float("nan") * touch_all  # NaN gradients: ZeRO's overflow check skips the step
            self.ds.backward(target, scale_wrt_gas=False)
        metrics = reduce_step_records(records, device=self.device)
        lr = self.current_lr
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else math.nan
        if not self.ds.was_step_applied() or not math.isfinite(metrics.get("loss", 0.0)):
            raise NonFiniteError(metrics.get("loss", math.nan), grad_norm)
        self.steps_done += 1
        return finish_step_metrics(metrics, grad_norm=grad_norm, lr=lr, started=start,
                                   padding_fraction=self.last_padding_fraction)

    # ----------------------------------------------------------------- learning-rate schedule
    @property
    def current_lr(self) -> float:
        """The learning rate the next ``train_step`` uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def lr_schedule_step(self) -> None:
        """Advance the learning-rate schedule by one trainer step."""
        self.scheduler.step(increment=1)

    def schedule_state_dict(self) -> dict:
        """Settings and position (``num_steps``, trainer steps) of the learning-rate schedule."""
        return self.scheduler.state_dict()

    def restore_schedule(self, saved: dict, *, position: int | None = None) -> list[str]:
        """Move the schedule to ``position`` (default: the saved ``num_steps``), keeping this engine's settings;
        returns the settings that changed, as ``"name old -> new"``."""
        return restore_lr_schedule(self.scheduler, saved, position)

    # ----------------------------------------------------------------- what it trains and holds
    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters of the whole model (``engine.deepspeed_figures``)."""
        from grpo_mega.engine.deepspeed_figures import parameter_counts

        return parameter_counts(self.module)

    def static_memory_bytes(self) -> dict[str, int]:
        """{"parameters", "gradients", "optimizer_state"}: bytes THIS rank holds, its ZeRO partitions at ZeRO-2/3
        (gradients, optimizer state) and ZeRO-3 (parameters) (``engine.deepspeed_figures``)."""
        from grpo_mega.engine.deepspeed_figures import static_memory_bytes

        return static_memory_bytes(self)

    # ----------------------------------------------------------------- checkpoints and weights
    def save_training_state(self, folder, *, rng_state, scheduler: dict, extra_state: dict) -> None:
        """Write model, ZeRO optimizer partitions, schedule, ``extra_state`` and this rank's RNG into ``folder``
        (a checkpoint's staging folder); collective. See ``grpo_mega.engine.deepspeed_checkpoint``."""
        from grpo_mega.engine.deepspeed_checkpoint import save_training_state

        save_training_state(self, folder, rng_state=rng_state, scheduler=scheduler, extra_state=extra_state)

    def load_training_state(self, folder, *, with_optimizer: bool, with_rng: bool) -> dict:
        """Restore what ``save_training_state`` wrote; returns {"scheduler", "extra_state", "rng_state" (None
        unless ``with_rng``), "optimizer_changes"}; collective."""
        from grpo_mega.engine.deepspeed_checkpoint import load_training_state

        return load_training_state(self, folder, with_optimizer=with_optimizer, with_rng=with_rng)

    def reload_after_weight_load(self) -> None:
        """ZeRO keeps fp32 master partitions of the weights: refresh them from the loaded model."""
        self.ds.optimizer.refresh_fp32_params()
