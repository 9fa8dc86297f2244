"""Splitting a global batch of variable-length rows across data-parallel ranks and into micro-batches.

Rows are padded only to the longest row of their own micro-batch. Micro-batches are filled by a token budget
(rows x padded length), longest rows first, so rows of similar length share a micro-batch and padding stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatchPlan:
    """Row indices of each micro-batch and the padded length each is cut to."""

    rows: list[torch.Tensor]
    lengths: list[int]
    real_tokens: int

    @property
    def padded_tokens(self) -> int:
        return sum(len(r) * n for r, n in zip(self.rows, self.lengths))

    @property
    def padding_fraction(self) -> float:
        """Share of computed token slots that are padding."""
        return 1.0 - self.real_tokens / max(self.padded_tokens, 1)


def shard_rows_for_data_parallel(lengths: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Row indices owned by ``dp_rank``: longest rows first, each to the rank with the fewest tokens so far
    (token totals differ by at most the longest row). Every rank computes the same deal from the same lengths, so
    no communication is needed. With at least ``dp_size`` rows every rank gets one; with fewer, the ranks after
    the first ``len(lengths)`` get none (the engine gives them a padding row)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is outside data_parallel={dp_size}")
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    loads = [0] * dp_size
    owned: list[list[int]] = [[] for _ in range(dp_size)]
    for index in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], len(owned[r]), r))
        owned[rank].append(index)
        loads[rank] += int(lengths[index])
    return torch.tensor(sorted(owned[dp_rank]), dtype=torch.long)


def plan_micro_batches(lengths: torch.Tensor, max_tokens_per_micro_batch: int) -> MicroBatchPlan:
    """Group rows into micro-batches whose padded size ``rows x longest row`` stays within the budget.

    A row longer than the budget gets a micro-batch of its own (it cannot be split).
    """
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    order = torch.argsort(lengths, descending=True, stable=True)
    rows: list[list[int]] = []
    padded_lengths: list[int] = []
    for index in order.tolist():
        length = int(lengths[index])
        if rows and (len(rows[-1]) + 1) * padded_lengths[-1] <= max_tokens_per_micro_batch:
            rows[-1].append(index)
        else:
            rows.append([index])
            padded_lengths.append(length)
    return MicroBatchPlan(
        rows=[torch.tensor(r, dtype=torch.long) for r in rows],
        lengths=padded_lengths,
        real_tokens=int(lengths.sum()),
    )


def slice_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """Select ``rows`` of every [B, ...] tensor and cut the per-token ones ([B, L, ...], L the length of
    ``batch["input_ids"]``) to ``length`` columns; other tensors ([B] or [B, K]) keep their columns."""
    seq_len = batch["input_ids"].shape[1]
    out = {}
    for name, value in batch.items():
        value = value.index_select(0, rows)
        if value.dim() >= 2 and value.shape[1] == seq_len:
            value = value[:, :length]
        out[name] = value.contiguous()
    return out


PADDING_ROW = -1
"""``row_index`` of a padding row: a data-parallel rank left without rows of its own (a batch with fewer rows than
data-parallel ranks) computes one so that it takes part in every collective; it never reaches the results."""


def is_padding(micro: dict[str, torch.Tensor]) -> bool:
    """True for a padding micro-batch (see ``PADDING_ROW``)."""
    return bool((micro["row_index"] == PADDING_ROW).all())


def padding_micro_batch(batch: dict[str, torch.Tensor], lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch's shortest row as a padding row: ``loss_mask`` 0, ``row_index`` PADDING_ROW (its loss adds 0)."""
    shortest = int(torch.argmin(lengths))
    micro = slice_rows(batch, torch.tensor([shortest]), int(lengths[shortest]))
    if "loss_mask" in micro:
        micro["loss_mask"] = torch.zeros_like(micro["loss_mask"])
    micro["row_index"] = torch.tensor([PADDING_ROW])
    return micro


def _row_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Real tokens of each row; ValueError for an empty batch."""
    lengths = batch["attention_mask"].sum(dim=1)
    if lengths.numel() == 0:
        raise ValueError("the batch has no rows: an engine step needs at least one row")
    return lengths


def rank_micro_batches(
    batch: dict[str, torch.Tensor], max_tokens_per_micro_batch: int, dp_rank: int, dp_size: int
) -> tuple[list[dict[str, torch.Tensor]], float]:
    """This data-parallel rank's micro-batches of ``batch`` (each with ``row_index``, its rows in the batch) and
    their padding fraction. A rank without rows gets one padding micro-batch (fraction 1). ValueError for an empty
    batch."""
    lengths = _row_lengths(batch)
    own_rows = shard_rows_for_data_parallel(lengths, dp_rank, dp_size)
    if own_rows.numel() == 0:
        return [padding_micro_batch(batch, lengths)], 1.0
    plan = plan_micro_batches(lengths[own_rows], max_tokens_per_micro_batch)
    micro_batches = []
    for rows, length in zip(plan.rows, plan.lengths):
        micro = slice_rows(batch, own_rows[rows], length)
        micro["row_index"] = own_rows[rows]
        micro_batches.append(micro)
    return micro_batches, plan.padding_fraction


def aligned_rank_micro_batches(
    batch: dict[str, torch.Tensor], max_tokens_per_micro_batch: int, dp_rank: int, dp_size: int
) -> tuple[list[dict[str, torch.Tensor]], float]:
    """:func:`rank_micro_batches` made the same shape on every data-parallel rank: each rank runs as many
    micro-batches as the rank with the most, and micro-batch i has the same rows x padded length everywhere (the
    largest of the ranks' i-th), filled with padding rows (``loss_mask`` 0, ``row_index`` PADDING_ROW).

    For a mixture-of-experts model whose experts are spread over data-parallel replicas (``parallel.expert`` >
    ``parallel.tensor``): megatron's token dispatcher gathers every expert-parallel rank's tokens of a micro-batch
    (equal sizes) in every MoE layer, so those ranks must step through micro-batches in lockstep. Every rank plans
    every rank's share from the same batch, so no communication is needed. A micro-batch may exceed the token budget
    by the difference between the ranks' shapes."""
    lengths = _row_lengths(batch)
    plans = []
    for rank in range(dp_size):
        own = shard_rows_for_data_parallel(lengths, rank, dp_size)
        plans.append((own, plan_micro_batches(lengths[own], max_tokens_per_micro_batch) if own.numel() else None))
    count = max(len(plan.rows) if plan else 1 for _, plan in plans)

    def shape(plan: MicroBatchPlan | None, index: int) -> tuple[int, int]:
        if plan is None or index >= len(plan.rows):
            return 1, 1
        return len(plan.rows[index]), plan.lengths[index]

    own, plan = plans[dp_rank]
    filler = int(torch.argmin(lengths))
    micro_batches, padded = [], 0
    for index in range(count):
        rows, length = (max(dim) for dim in zip(*(shape(p, index) for _, p in plans)))
        mine = own[plan.rows[index]] if plan is not None and index < len(plan.rows) else own[:0]
        fill = torch.full((rows - len(mine),), filler, dtype=torch.long)
        micro = slice_rows(batch, torch.cat([mine, fill]), length)
        if len(fill) and "loss_mask" in micro:  # slice_rows made new tensors: the batch is not touched
            micro["loss_mask"][len(mine):] = 0
        micro["row_index"] = torch.cat([mine, torch.full((len(fill),), PADDING_ROW, dtype=torch.long)])
        micro_batches.append(micro)
        padded += rows * length
    real = int(lengths[own].sum()) if own.numel() else 0
    return micro_batches, 1.0 - real / max(padded, 1)
