"""Micro-batches in which the G completions of a prompt share one copy of the prompt's tokens.

In a GRPO batch every prompt appears G times (``prompt + response_i``). Everything in a transformer layer except
attention works token by token, so the prompt's tokens need to go through the layers only once per group: the
micro-batch is *packed* into one sequence ``[prompt, response_1, ..., response_G, next prompt, ...]`` of T tokens
([T, 1] for megatron), and only attention (``grpo_mega.model.attention``) and rotary positions
(``grpo_mega.model.gpt``) see the rows. The packed form is exact: each row's attention sees its own prompt and
response, at the positions it has in its row, and a prompt's gradient is the sum over its G rows (index_select's
backward). What it saves is the share of prompt tokens times (G - 1) / G of the linear layers, norms and MLPs.

A packed micro-batch keeps the row-form fields of an ordinary one (``input_ids`` [R, L], ``loss_mask``, ...,
``row_index``) and adds three index tensors:

- ``packed_source`` [T]: for packed token t, its flat position ``r * L + p`` in the micro-batch's rows (a prompt
  token is taken from the first row of its group);
- ``packed_positions`` [T]: its position p in its row (the rotary position);
- ``packed_row_gather`` [R, L]: for each row position, the packed token that holds it (positions past a row's end
  point at its last token: causal attention keeps them out of every real token's view, and heads mask them).

Rows share a prompt when their ``prompt_lengths`` and prompt tokens are equal; nothing else about groups is
needed. A group that does not fit the token budget is split into several units, each with its own prompt copy.
"""

from __future__ import annotations

import torch

from grpo_mega.engine.batching import padding_micro_batch, shard_rows_for_data_parallel, slice_rows


def is_packed(micro: dict[str, torch.Tensor]) -> bool:
    """True for a micro-batch built by :func:`rank_shared_prefix_micro_batches` (not a padding one)."""
    return "packed_source" in micro


def prompt_groups(input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> list[list[int]]:
    """Rows with the same prompt (equal length and tokens), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for row, length in enumerate(prompt_lengths.tolist()):
        if length < 1 or length > input_ids.shape[1]:
            raise ValueError(f"row {row}: prompt length {length} outside 1..{input_ids.shape[1]}")
        groups.setdefault(tuple(input_ids[row, :length].tolist()), []).append(row)
    return list(groups.values())


def _units(groups: list[list[int]], lengths: list[int], prompt_lengths: list[int], budget: int) -> list[list[int]]:
    """Each group's rows cut into units whose packed size (prompt once + every row's response) fits ``budget``
    (a unit has at least one row)."""
    units = []
    for rows in groups:
        prompt = prompt_lengths[rows[0]]
        unit, size = [], prompt
        for row in rows:
            response = lengths[row] - prompt
            if unit and size + response > budget:
                units.append(unit)
                unit, size = [], prompt
            unit.append(row)
            size += response
        units.append(unit)
    return units


def _packed_size(unit: list[int], lengths: list[int], prompt_lengths: list[int]) -> int:
    return prompt_lengths[unit[0]] + sum(lengths[row] - prompt_lengths[row] for row in unit)


def pack_rows(micro: dict[str, torch.Tensor], units: list[list[int]], prompt_lengths: list[int]) -> None:
    """Add the packed index tensors (module docstring) to a row-form micro-batch, in place. ``units`` are lists
    of the micro-batch's row numbers that share a prompt of ``prompt_lengths[unit[0]]`` tokens."""
    rows, width = micro["input_ids"].shape
    lengths = micro["attention_mask"].sum(dim=1).tolist()
    source, positions = [], []
    row_gather = torch.zeros(rows, width, dtype=torch.long)
    start = 0
    for unit in units:
        prompt = prompt_lengths[unit[0]]
        prompt_tokens = torch.arange(start, start + prompt)
        source.append(unit[0] * width + torch.arange(prompt))
        positions.append(torch.arange(prompt))
        start += prompt
        for row in unit:
            response = torch.arange(prompt, lengths[row])
            packed = torch.arange(start, start + len(response))
            source.append(row * width + response)
            positions.append(response)
            row_gather[row, :prompt] = prompt_tokens
            row_gather[row, prompt: lengths[row]] = packed
            row_gather[row, lengths[row]:] = start + len(response) - 1 if len(response) else prompt_tokens[-1]
            start += len(response)
    micro["packed_source"] = torch.cat(source)
    micro["packed_positions"] = torch.cat(positions)
    micro["packed_row_gather"] = row_gather


def rank_shared_prefix_micro_batches(
    batch: dict[str, torch.Tensor], max_tokens_per_micro_batch: int, dp_rank: int, dp_size: int
) -> tuple[list[dict[str, torch.Tensor]], float]:
    """This data-parallel rank's packed micro-batches of ``batch`` (which needs ``prompt_lengths``) and their
    padding fraction (0: packed tokens carry no padding). Units (a prompt's rows, or a part of them) are dealt to
    ranks largest first, then filled into micro-batches of at most ``max_tokens_per_micro_batch`` packed tokens
    (a unit larger than that gets one of its own). A rank without units gets one padding micro-batch (fraction 1)."""
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    lengths_t = batch["attention_mask"].sum(dim=1)
    if lengths_t.numel() == 0:
        raise ValueError("the batch has no rows: an engine step needs at least one row")
    lengths, prompt_lengths = lengths_t.tolist(), batch["prompt_lengths"].tolist()
    for row, (length, prompt) in enumerate(zip(lengths, prompt_lengths)):
        if prompt > length:
            raise ValueError(f"row {row}: prompt_lengths {prompt} exceeds its {length} tokens")
    units = _units(prompt_groups(batch["input_ids"], batch["prompt_lengths"]), lengths, prompt_lengths,
                   max_tokens_per_micro_batch)
    sizes = [_packed_size(unit, lengths, prompt_lengths) for unit in units]
    # units dealt like rows: largest first, each to the rank with the fewest packed tokens so far
    owned = shard_rows_for_data_parallel(torch.tensor(sizes), dp_rank, dp_size).tolist()
    if not owned:
        return [padding_micro_batch(batch, lengths_t)], 1.0
    # first fit, largest units first
    bins: list[list[int]] = []
    filled: list[int] = []
    for index in sorted(owned, key=lambda i: -sizes[i]):
        for b, used in enumerate(filled):
            if used + sizes[index] <= max_tokens_per_micro_batch:
                bins[b].append(index)
                filled[b] += sizes[index]
                break
        else:
            bins.append([index])
            filled.append(sizes[index])
    micro_batches = []
    for members in bins:
        rows = [row for index in members for row in units[index]]
        local, offset = [], 0
        for index in members:
            local.append(list(range(offset, offset + len(units[index]))))
            offset += len(units[index])
        row_index = torch.tensor(rows, dtype=torch.long)
        micro = slice_rows(batch, row_index, max(lengths[row] for row in rows))
        micro["row_index"] = row_index
        pack_rows(micro, local, [prompt_lengths[row] for row in rows])
        micro_batches.append(micro)
    return micro_batches, 0.0
