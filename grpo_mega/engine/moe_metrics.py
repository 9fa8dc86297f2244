"""What a mixture-of-experts model's training step reports about its routing: each MoE layer's load-balancing loss
and how evenly its experts are loaded.

- ``moe/load_balancing_loss/layer_N`` and ``moe/load_balancing_loss`` (mean over layers): megatron's ``aux_loss``
  (Switch-style, E * sum_e f_e P_e, 1 for perfectly even routing) of each layer without its coefficient, as
  megatron's own logging reports it (``moe_utils.track_moe_metrics``): the per-micro-batch values megatron's router
  keeps (``save_to_aux_losses_tracker``), averaged over micro-batches and data-parallel ranks. Only computed when
  the coefficient (``model.moe_aux_loss_coeff``, default the HF config's) is above 0.
- ``moe/expert_load_max_over_mean/layer_N`` and ``moe/expert_load_max_over_mean`` (the largest over layers): the
  tokens routed to the busiest expert over the mean per expert in the step's training forward passes (1 = even;
  E / k = every token on the same k experts), counted from each router's routing map by a forward hook.

Padding tokens of right-padded rows are routed like the others and count in both (megatron 0.16 can mask them,
``padding_mask``, which grpo-mega does not pass yet).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

AUX_LOSS_NAME = "load_balancing_loss"
"""The name megatron's router records its ``aux_loss`` under in the MoE logging tracker."""


class RouterLoadProbe:
    """Forward hooks on the MoE routers of one pipeline stage that count, per layer, the tokens routed to each
    expert during training forward passes (``module.training``: not the log-prob passes), and the step's report."""

    def __init__(self, stage: torch.nn.Module, config) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers = config.num_layers
        self.num_experts = config.num_moe_experts
        self.sequence_parallel = config.sequence_parallel
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.routers = [module for module in stage.modules() if isinstance(module, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs) -> None:
        if router.training:
            _, routing_map = outputs  # [tokens, experts], True where a token goes to an expert
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0).to(self.counts)

    def step_metrics(self, num_micro_batches: int, device: torch.device) -> dict[str, float]:
        """The step's routing figures (collective over all ranks), and the counts and tracker reset."""
        counts = self.counts.to(device, copy=True)
        if self.sequence_parallel:  # each TP rank routed its slice of the sequence
            dist.all_reduce(counts, group=mpu.get_tensor_model_parallel_group())
        dist.all_reduce(counts, group=mpu.get_data_parallel_group())
        dist.all_reduce(counts, group=mpu.get_pipeline_model_parallel_group())  # each stage its own layers
        self.counts.zero_()
        metrics: dict[str, float] = {}
        ratios = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
        for layer, ratio in enumerate(ratios.tolist()):
            metrics[f"moe/expert_load_max_over_mean/layer_{layer}"] = ratio
        metrics["moe/expert_load_max_over_mean"] = float(ratios.max())
        metrics.update(_aux_loss_metrics(num_micro_batches))
        return metrics


def _aux_loss_metrics(num_micro_batches: int) -> dict[str, float]:
    """Each layer's load-balancing loss from megatron's tracker (this rank's micro-batch sum), averaged over this
    rank's micro-batches, then reduced as megatron reduces it (summed over the pipeline and the TP x CP group that
    routes one sequence, averaged over data-parallel ranks); the tracker is cleared."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    if AUX_LOSS_NAME not in tracker:
        return {}
    tracker[AUX_LOSS_NAME]["values"] /= max(num_micro_batches, 1)
    reduce_aux_losses_tracker_across_ranks([AUX_LOSS_NAME])
    values = tracker[AUX_LOSS_NAME]["values"].tolist()
    clear_aux_losses_tracker()
    metrics = {f"moe/load_balancing_loss/layer_{layer}": value for layer, value in enumerate(values)}
    metrics["moe/load_balancing_loss"] = sum(values) / len(values)
    return metrics
