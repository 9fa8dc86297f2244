"""Training engine on megatron-core: TP / PP / DP through its DDP, optimizer and pipeline schedules.

One engine trains any model made of a GPT backbone stage and, on the last pipeline stage, a pluggable head
(the LM head for the policy, a step-scoring head for the PRM). The loss is pluggable too (``LossFn``).
The same code runs with NCCL on GPUs and with gloo on CPUs (``grpo_mega.parallel`` applies the CPU layer).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from grpo_mega.engine.base import LossFn, LossScale
from grpo_mega.engine.batching import plan_micro_batches, shard_rows_for_data_parallel, slice_rows
from grpo_mega.parallel import get_device

StageModelProvider = Callable[[bool, bool], torch.nn.Module]
"""``provider(pre_process, post_process)`` builds this rank's pipeline stage: a GPT backbone stage whose
``forward(input_ids, position_ids, attention_mask)`` returns hidden states [S, B, H]. On the last stage it carries
its head as the submodule ``head``, called as ``head(backbone, hidden, micro_batch) -> {name: [B, S]}``: a
submodule of the backbone, so head parameters (if any) are trained, reduced and checkpointed with the rest, and
megatron's schedules and gradient finalisation see a stock GPTModel."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def align_to_tokens(next_token_values: torch.Tensor) -> torch.Tensor:
    """Shift [B, S] values about the *next* token (position t predicts t + 1) right by one, so out[:, t] is
    about token t (the engine's convention); out[:, 0] = 0 (the first token has no prediction)."""
    return torch.nn.functional.pad(next_token_values[:, :-1], (1, 0), value=0.0)


class MegatronEngine:
    """Megatron-core engine behind the :class:`~grpo_mega.engine.base.TrainingEngine` interface.

    Args:
        stage_model_provider: builds this rank's stage (see ``StageModelProvider``).
        optim: learning rate, AdamW and schedule settings (``grpo_mega.config.OptimConfig``).
        total_steps: optimizer steps of the run (length of the learning-rate decay).
        max_tokens_per_micro_batch: token budget of a micro-batch (rows x padded length).
        output_names: names of the per-token outputs of the head (known on every stage).
        next_token_head: the head's value at position t is about token t + 1 (an LM head); the engine
            re-aligns it so that position t is about token t.
        hf_config: the Hugging Face config of the backbone (names and layouts for HF export).
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
    ):
        self.device = get_device()
        self.pre_process = mpu.is_pipeline_first_stage()
        self.post_process = mpu.is_pipeline_last_stage()
        self.output_names = tuple(output_names)
        self.next_token_head = next_token_head
        self.hf_config = hf_config
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        module = stage_model_provider(self.pre_process, self.post_process).to(self.device)
        self.config = module.config
        # Rows of a micro-batch vary in length: pipeline stages exchange tensor shapes before tensors.
        self.config.variable_seq_lengths = True
        self.config.finalize_model_grads_func = finalize_model_grads
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            module=module,
        )
        bf16 = self.config.bf16
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
                use_distributed_optimizer=False,
            ),
            [self.model],
            # The global group is already gloo on CPU; on GPU the optimizer needs no extra gloo groups either.
            use_gloo_process_groups=False,
        )
        warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if warmup else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(total_steps, warmup + 1),
            lr_decay_style=optim.decay_style,
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )
        self.steps_done = 0

    # ----------------------------------------------------------------- micro-batches of this rank
    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        lengths = batch["attention_mask"].sum(dim=1)
        own_rows = shard_rows_for_data_parallel(
            lengths, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        )
        plan = plan_micro_batches(lengths[own_rows], self.max_tokens_per_micro_batch)
        self.last_padding_fraction = plan.padding_fraction
        micro_batches = []
        for rows, length in zip(plan.rows, plan.lengths):
            global_rows = own_rows[rows]
            micro = slice_rows(batch, global_rows, length)
            micro["row_index"] = global_rows
            micro_batches.append({k: v.to(self.device) for k, v in micro.items()})
        return micro_batches

    def _run_schedule(self, micro_batches, loss_func_for, forward_only: bool) -> list[dict]:
        """Run megatron's schedule (1F1B with PP) and return the loss-function records of the last stage."""
        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            positions = torch.arange(micro["input_ids"].shape[1], device=self.device).expand_as(micro["input_ids"])
            # Rows are right-padded: the causal mask alone keeps padding out of every real token's attention.
            hidden = model(micro["input_ids"], positions, attention_mask=None)
            return hidden, loss_func_for(micro)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(m["input_ids"].shape[1] for m in micro_batches),
            micro_batch_size=max(m["input_ids"].shape[0] for m in micro_batches),
            forward_only=forward_only,
        )

    def _head(self, hidden: torch.Tensor, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stage = self.stage
        outputs = stage.head(stage, hidden, micro)
        if self.next_token_head:
            outputs = {name: align_to_tokens(value) for name, value in outputs.items()}
        return outputs

    # ----------------------------------------------------------------- the interface
    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Head outputs {name: [B, L]} of the whole batch, the same on every rank (no gradient)."""
        self.model.eval()
        micro_batches = self._micro_batches(batch)
        rows, length = batch["input_ids"].shape
        outputs = {name: torch.zeros(rows, length, dtype=torch.float32, device=self.device) for name in self.output_names}

        def loss_func_for(micro):
            def collect(hidden):
                head_out = self._head(hidden, micro)
                for name in self.output_names:
                    value = head_out[name].float()
                    outputs[name][micro["row_index"], : value.shape[1]] = value
                return torch.zeros((), device=self.device), {}

            return collect

        self._run_schedule(micro_batches, loss_func_for, forward_only=True)
        # Each row was computed on one DP rank's last stage; zeros elsewhere, so sums assemble the batch.
        for value in outputs.values():
            dist.all_reduce(value, group=mpu.get_data_parallel_group())
            dist.all_reduce(value, group=mpu.get_pipeline_model_parallel_group())
        return {name: value.cpu() for name, value in outputs.items()}

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [B, L] of ``input_ids`` (needs a head with those outputs)."""
        outputs = self.forward(batch)
        return outputs["logprobs"], outputs["entropy"]

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` with ``loss_fn``; metrics are summed over micro-batches / ranks."""
        self.model.train()
        start = time.perf_counter()
        loss_mask = batch["loss_mask"].float()
        scale = LossScale(
            global_tokens=float(loss_mask.sum().clamp(min=1)),
            global_seqs=float((loss_mask.sum(dim=1) > 0).sum().clamp(min=1)),
        )
        micro_batches = self._micro_batches(batch)
        # megatron divides each micro-batch loss by the number of micro-batches and averages gradients over DP
        # ranks; loss_fn returns shares of the global loss, so undo both averages.
        undo_average = len(micro_batches) * mpu.get_data_parallel_world_size()

        def loss_func_for(micro):
            def compute(hidden):
                loss, metrics = loss_fn(self._head(hidden, micro), micro, scale)
                record = {name: float(value) for name, value in metrics.items()}
                record["loss"] = float(loss.detach())
                return loss * undo_average, record

            return compute

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        records = self._run_schedule(micro_batches, loss_func_for, forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        self.scheduler.step(increment=1)
        self.steps_done += 1
        metrics = self._reduce_records(records)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
            lr=self.optimizer.param_groups[0]["lr"],
            step_seconds=time.perf_counter() - start,
            padding_fraction=self.last_padding_fraction,
        )
        return metrics

    def _reduce_records(self, records: list[dict]) -> dict[str, float]:
        """Sum the last stage's per-micro-batch records over micro-batches and DP ranks; share with all ranks."""
        totals: dict[str, float] = {}
        for record in records:
            for name, value in record.items():
                totals[name] = totals.get(name, 0.0) + value
        names = [sorted(totals)]
        last_stage = mpu.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(names, src=last_stage, group=mpu.get_pipeline_model_parallel_group())
        values = torch.tensor([totals.get(n, 0.0) for n in names[0]], dtype=torch.float64, device=self.device)
        if not self.post_process:
            values.zero_()
        dist.all_reduce(values, group=mpu.get_data_parallel_group())
        dist.all_reduce(values, group=mpu.get_pipeline_model_parallel_group())
        return dict(zip(names[0], values.tolist()))

    def export_hf_weights(self):
        """(HF name, full tensor) one at a time, gathered over TP / PP; collective (every rank iterates)."""
        from grpo_mega.checkpoint.hf_convert import export_hf_weights

        return export_hf_weights(self.stage, self.hf_config)

    # ----------------------------------------------------------------- model weights (sharded, any layout)
    @property
    def stage(self):
        """This rank's pipeline stage (the backbone with its head), unwrapped from DDP."""
        return _unwrap(self.model)

    def save_model_weights(self, directory: str) -> None:
        """Write the model with megatron dist_checkpointing (collective); loadable at any TP / PP."""
        from megatron.core import dist_checkpointing

        Path(directory).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self.stage.sharded_state_dict(), directory)

    def load_model_weights(self, directory: str) -> None:
        """Load weights written by :meth:`save_model_weights` at any TP / PP (collective)."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(self.stage.sharded_state_dict(), directory)
        self.stage.load_state_dict(state)
        # bf16 training keeps fp32 master copies in the optimizer: refresh them from the loaded weights.
        self.optimizer.reload_model_params()
