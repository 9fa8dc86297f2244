"""The bookkeeping every engine's ``train_step`` shares: the global loss normalisers of a batch, each
micro-batch's record of its loss and metrics, and their reduction over micro-batches and ranks into the step's
metrics. Both engines (``megatron_engine``, ``deepspeed_engine``) call these, so a step reports the same numbers
whichever engine runs it."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from grpo_mega.engine.base import LossScale


def global_loss_scale(batch: dict[str, torch.Tensor]) -> LossScale:
    """Tokens with ``loss_mask`` set and rows with at least one, over the whole batch (at least 1 each)."""
    loss_mask = batch["loss_mask"].float()
    return LossScale(
        global_tokens=float(loss_mask.sum().clamp(min=1)),
        global_seqs=float((loss_mask.sum(dim=1) > 0).sum().clamp(min=1)),
    )


def micro_batch_record(loss: torch.Tensor, metrics: dict) -> dict[str, float]:
    """A loss function's metrics of one micro-batch as floats, with its ``loss`` share."""
    record = {name: float(value) for name, value in metrics.items()}
    record["loss"] = float(loss.detach())
    return record


def reduce_step_records(
    records: list[dict], *, device: torch.device, groups: tuple = (None,), contributes: bool = True
) -> dict[str, float]:
    """The step's metrics from this rank's per-micro-batch records, the same on every rank.

    Records are summed (loss functions return shares of the global batch), except names ending in ``_max``, which
    are maxima; then reduced over each process group of ``groups`` in turn (None: the whole job). Metric names are
    the union over all ranks (a rank that computed only a padding row has none). A rank that holds no loss values
    (``contributes`` False, e.g. a pipeline stage before the last) takes part with neutral values."""
    totals: dict[str, float] = {}
    for record in records:
        for name, value in record.items():
            combine = max if name.endswith("_max") else (lambda a, b: a + b)
            totals[name] = combine(totals[name], value) if name in totals else value
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(totals))
    names = sorted(set().union(*gathered))
    reduced = {}
    for is_max in (False, True):
        group_names = [n for n in names if n.endswith("_max") == is_max]
        missing = -math.inf if is_max else 0.0
        values = torch.tensor([totals.get(n, missing) if contributes else missing for n in group_names],
                              dtype=torch.float64, device=device)
        op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
        for group in groups:
            dist.all_reduce(values, op=op, group=group)
        reduced.update(zip(group_names, values.tolist()))
    return reduced


def finish_step_metrics(metrics: dict[str, float], *, grad_norm: float, lr: float, started: float,
                        padding_fraction: float) -> dict[str, float]:
    """Add what every step reports besides its loss function's metrics: ``grad_norm`` (before clipping), ``lr``,
    ``step_seconds`` (since ``started``, a ``time.perf_counter()``) and ``padding_fraction``."""
    metrics.update(grad_norm=grad_norm, lr=lr, step_seconds=time.perf_counter() - started,
                   padding_fraction=padding_fraction)
    return metrics
