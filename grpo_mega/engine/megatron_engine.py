"""Training engine on megatron-core: TP / PP / DP through its DDP, optimizer and pipeline schedules.

One engine trains any model made of a GPT backbone stage and, on the last pipeline stage, a pluggable head
(the LM head for the policy, a step-scoring head for the PRM). The loss is pluggable too (``LossFn``).
The same code runs with NCCL on GPUs and with gloo on CPUs (``grpo_mega.parallel`` applies the CPU layer).

A step checks the loss and the global gradient norm before the optimizer touches anything: a NaN or Inf raises
:class:`~grpo_mega.engine.base.NonFiniteError` on every rank with the parameters and optimizer state unchanged.
The learning-rate schedule counts trainer steps (``lr_schedule_step``), not optimizer steps.

With ``parallel.offload_during_rollout`` the trainer calls ``offload_to_host`` before generation and
``reload_from_host`` before the update (``grpo_mega.engine.offload``); every method that needs the gradient buffers
or the optimizer state takes them back first, so a forgotten reload costs time, never correctness.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer

from grpo_mega.engine.base import LossFn, NonFiniteError
from grpo_mega.engine.batching import is_padding
from grpo_mega.engine.distributed_optimizer import (
    CHECKPOINT_METADATA,
    load_distributed_optimizer_state,
    prepare_distributed_optimizer_load,
    shards_optimizer_state,
    static_memory_bytes,
)
from grpo_mega.engine.fused_adam import fused_adam_for_device
from grpo_mega.engine.lr_schedule import (
    build_lr_schedule, keep_optimizer_settings, optimizer_settings, restore_lr_schedule,
)
from grpo_mega.engine.offload import StorageOffload, device_bytes, megatron_grad_buffers, megatron_optimizer_state
from grpo_mega.engine.megatron_base import (
    MegatronStageEngine, StageModelProvider, assembled_rows, keep_rows, layer_tokens, row_buffers,
)
from grpo_mega.engine.moe_metrics import RouterLoadProbe
from grpo_mega.engine.step_records import (
    finish_step_metrics,
    global_loss_scale,
    micro_batch_record,
    reduce_step_records,
)


class MegatronEngine(MegatronStageEngine):
    """Megatron-core engine behind the :class:`~grpo_mega.engine.base.TrainingEngine` interface.

    Args:
        stage_model_provider: builds this rank's stage (see ``StageModelProvider``).
        optim: learning rate, AdamW and schedule settings (``grpo_mega.config.OptimConfig``).
        total_steps: length of the learning-rate schedule in schedule steps, i.e. trainer steps
            (``lr_schedule_step`` advances it; ``train_step`` does not).
        max_tokens_per_micro_batch: token budget of a micro-batch (rows x padded length).
        output_names: names of the per-token outputs of the head (known on every stage).
        next_token_head: the head's value at position t is about token t + 1 (an LM head); the engine
            re-aligns it so that position t is about token t.
        hf_config: the Hugging Face config of the backbone (names and layouts for HF export).
        share_prompt_prefix: rows of a batch with ``prompt_lengths`` that share a prompt go through the layers
            with one copy of it (``grpo_mega.engine.shared_prefix``; exact, megatron's local layers only).
        distributed_optimizer: shard the fp32 master weights and Adam moments over the data-parallel ranks
            (megatron's DistributedOptimizer) when DP > 1 (``parallel.distributed_optimizer``); exact.
        attach_adapters: ``stage -> grpo_mega.lora.StageAdapters | None`` (``model.lora``): freezes the stage's
            weights and attaches LoRA adapters before DDP and the optimizer are built, so both hold the adapters only.
    """

    def __init__(
        self,
        stage_model_provider: StageModelProvider,
        *,
        optim,
        total_steps: int,
        max_tokens_per_micro_batch: int,
        output_names: tuple[str, ...],
        next_token_head: bool,
        hf_config=None,
        share_prompt_prefix: bool = False,
        distributed_optimizer: bool = True,
        attach_adapters=None,
    ):
        module = self._build_stage(
            stage_model_provider,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            output_names=output_names,
            next_token_head=next_token_head,
            hf_config=hf_config,
            share_prompt_prefix=share_prompt_prefix,
        )
        self.lora = attach_adapters(module) if attach_adapters is not None else None
        self.config.finalize_model_grads_func = finalize_model_grads
        self.distributed_optimizer = shards_optimizer_state(distributed_optimizer)
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=self.distributed_optimizer,
            ),
            module=module,
        )
        bf16 = self.config.bf16
        self.clip_grad = optim.clip_grad
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=self.distributed_optimizer,
            ),
            [self.model],
            # The global group is already gloo on CPU; on GPU the optimizer needs no extra gloo groups either.
            use_gloo_process_groups=False,
        )
        fused_adam_for_device(self.optimizer, self.device)  # torch's fused AdamW on CUDA without TE / apex
        self.scheduler = build_lr_schedule(self.optimizer, optim, total_steps)
        self.steps_done = 0
        self._offload = StorageOffload()
        # mixture-of-experts models: each step also reports its routing (grpo_mega.engine.moe_metrics)
        self.router_probe = RouterLoadProbe(module, self.config) if self.config.num_moe_experts else None

    # ----------------------------------------------------------------- training
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` with ``loss_fn`` at the current learning rate; metrics are summed
        over micro-batches / ranks. Raises NonFiniteError (nothing applied) for a NaN / Inf loss or grad norm."""
        return self.train_step_with_outputs(batch, loss_fn, ())[0]

    def train_step_with_outputs(self, batch: dict[str, torch.Tensor], loss_fn: LossFn,
                                names: tuple[str, ...]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """:meth:`train_step`, and the head outputs ``names`` of the step's own forward pass (the weights before
        the update), {name: [B, L] fp32 on the CPU} in the batch's row order, the same on every rank (gathered over
        DP and from the last pipeline stage as :meth:`forward` gathers them). The implicit PRM's ``update: after``
        scores with them instead of a forward of its own (``grpo_mega.stages.implicit_prm``)."""
        self.reload_from_host()
        self.model.train()
        start = time.perf_counter()
        scale = global_loss_scale(batch)
        micro_batches = self._micro_batches(batch)
        # megatron divides each micro-batch loss by the number of micro-batches and averages gradients over DP
        # ranks; loss_fn returns shares of the global loss, so undo both averages.
        undo_average = len(micro_batches) * mpu.get_data_parallel_world_size()
        kept = row_buffers(names, batch, self.device)

        def loss_func_for(micro):
            def compute(hidden):
                if is_padding(micro):
                    # A DP rank without rows: its gradient must be exactly zero whatever loss_fn makes of an
                    # all-masked row, so the loss is tied to the stage output only, and it reports no metrics.
                    return hidden.float().sum() * 0.0, {}
                head_out = self._head(hidden, micro, loss_tokens_only=True)  # losses read loss_mask's tokens
                keep_rows(kept, head_out, micro)
                loss, metrics = loss_fn(head_out, micro, scale)
                record = micro_batch_record(loss, metrics)
                record["layer_tokens"] = float(layer_tokens(micro))
                return loss * undo_average, record

            return compute

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        records = self._run_schedule(micro_batches, loss_func_for, forward_only=False)
        # Records live on the last pipeline stage; reduced over DP ranks, then shared along the pipeline.
        metrics = reduce_step_records(
            records, device=self.device, contributes=self.post_process,
            groups=(mpu.get_data_parallel_group(), mpu.get_pipeline_model_parallel_group()),
        )
        if self.router_probe is not None:
            metrics.update(self.router_probe.step_metrics(len(micro_batches), self.device))
        lr = self.current_lr
        grad_norm = self._apply_update(metrics.get("loss", 0.0))
        self.steps_done += 1
        outputs = assembled_rows(kept) if names else {}
        return finish_step_metrics(metrics, grad_norm=grad_norm, lr=lr, started=start,
                                   padding_fraction=self.last_padding_fraction), outputs

    def _sub_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    @torch.no_grad()
    def _apply_update(self, loss: float) -> float:
        """Check loss and global grad norm, clip, step; returns the grad norm (before clipping).

        megatron's ``optimizer.step()`` split in its parts so that nothing is applied to a non-finite step:
        prepare_grads (grads to the optimizer's main grads), get_grad_norm (global over TP / PP; DP ranks hold
        the same reduced grads, or with the distributed optimizer each its shard of them, and the norm is then
        reduced over DP too), clipping by that norm, step_with_ready_grads (which, with the distributed
        optimizer, all-gathers the updated parameters).
        """
        found_inf = bool(self.optimizer.prepare_grads())  # only a grad scaler (fp16) finds inf here
        grad_norm = float(self.optimizer.get_grad_norm())
        bad = torch.tensor(
            [float(found_inf or not math.isfinite(loss) or not math.isfinite(grad_norm))], device=self.device
        )
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank raises, or none does
        if bad.item() > 0:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            raise NonFiniteError(loss, grad_norm)
        if self.clip_grad > 0.0:
            for sub in self._sub_optimizers():
                params = sub.get_parameters()
                if getattr(sub, "is_stub_optimizer", False) or not params:
                    continue
                # Looked up on megatron's optimizer module, where the CPU layer wraps it (grad.type() check).
                megatron_optimizer.clip_grad_by_total_norm_fp32(
                    params, max_norm=self.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        if not self.optimizer.step_with_ready_grads():
            raise RuntimeError("megatron's optimizer reported a failed step with finite gradients")
        return grad_norm

    def static_memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: {"parameters", "gradients", "optimizer_state"} (fp32 master copies and Adam
        state, allocated at the first step), each storage counted once; see
        ``grpo_mega.engine.distributed_optimizer.static_memory_bytes``."""
        return static_memory_bytes(self.stage, self.model, self.optimizer)

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
        """Move the schedule to ``position`` (default: the saved ``num_steps``) and keep this engine's settings
        (from the current config); returns the settings that changed, e.g. ``["lr_decay_steps 2 -> 4"]``."""
        return restore_lr_schedule(self.scheduler, saved, position)

    # ----------------------------------------------------------------- offload during rollout
    def offload_to_host(self) -> int:
        """Release the gradient buffers (their content is dead between optimizer steps) and move the optimizer
        state (moments, fp32 master copies) to host memory; returns the device bytes released. No-op when
        already offloaded."""
        if self._offload.active:
            return 0
        return self._offload.offload(keep=self._optimizer_tensors(), discard=megatron_grad_buffers(self.model))

    def reload_from_host(self) -> int:
        """Bring back what ``offload_to_host`` released (exactly; gradient buffers zeroed); returns the bytes."""
        return self._offload.restore()

    def held_bytes(self) -> dict[str, int]:
        """Bytes this engine holds for training beyond the weights: ``grad_buffers`` and ``optimizer_state`` on
        the training device, ``host`` offloaded to host memory."""
        return {"grad_buffers": device_bytes(megatron_grad_buffers(self.model)),
                "optimizer_state": device_bytes(self._optimizer_tensors()), "host": self._offload.host_bytes}

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return megatron_optimizer_state(self.optimizer, self.stage.parameters())

    # ----------------------------------------------------------------- optimizer state and weights
    def optimizer_sharded_state_dict(self, model_sharded_state: dict, *, is_loading: bool) -> dict:
        """The optimizer's ShardedStateDict over ``model_sharded_state`` (from ``model_sharded_state_dict``); with
        the distributed optimizer in megatron's ``fully_reshardable`` format (loadable at any TP / PP / DP)."""
        self.reload_from_host()
        if not self.distributed_optimizer:
            return self.optimizer.sharded_state_dict(model_sharded_state, is_loading=is_loading)
        if is_loading:
            prepare_distributed_optimizer_load(self.optimizer)
        return self.optimizer.sharded_state_dict(model_sharded_state, is_loading=is_loading,
                                                 metadata=CHECKPOINT_METADATA)

    def load_optimizer_state_dict(self, state: dict) -> list[str]:
        """Restore a loaded optimizer state: moments, step counts and, with bf16, the fp32 master copies. The
        hyperparameters (betas, eps, peak / min lr, weight-decay multipliers) stay the ones this engine was built
        with, from the current config; returns those that differ from the checkpoint's, as ``"name old -> new"``
        (``lr`` and ``weight_decay`` are set by the schedule: see ``restore_schedule``)."""
        self.reload_from_host()
        built = optimizer_settings(self.optimizer)
        if self.distributed_optimizer:
            load_distributed_optimizer_state(self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)
        return keep_optimizer_settings(self.optimizer, built)

    def reload_after_weight_load(self) -> None:
        """bf16 training keeps fp32 master copies in the optimizer: refresh them from the loaded weights."""
        self.reload_from_host()
        self.optimizer.reload_model_params()
