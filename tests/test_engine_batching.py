"""Data-parallel sharding and token-budget micro-batching."""

import pytest
import torch

from grpo_mega.engine.batching import plan_micro_batches, shard_rows_for_data_parallel, slice_rows


def test_every_row_in_exactly_one_micro_batch_within_budget():
    lengths = torch.tensor([5, 17, 3, 9, 9, 30, 1, 12])
    plan = plan_micro_batches(lengths, max_tokens_per_micro_batch=32)
    rows = torch.cat(plan.rows).sort().values
    assert torch.equal(rows, torch.arange(8))
    for mb_rows, padded in zip(plan.rows, plan.lengths):
        assert padded == int(lengths[mb_rows].max())
        assert len(mb_rows) * padded <= 32
    assert plan.real_tokens == int(lengths.sum())


def test_similar_lengths_share_micro_batches_so_padding_is_small():
    torch.manual_seed(0)
    lengths = torch.randint(10, 100, (64,))
    plan = plan_micro_batches(lengths, max_tokens_per_micro_batch=400)
    naive_padding = 1 - lengths.sum().item() / (lengths.max().item() * 64)
    assert plan.padding_fraction < 0.1 < naive_padding


def test_row_longer_than_budget_goes_alone():
    plan = plan_micro_batches(torch.tensor([50, 4, 4]), max_tokens_per_micro_batch=10)
    assert [r.tolist() for r in plan.rows] == [[0], [1, 2]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches(torch.tensor([1]), 0)


def test_data_parallel_shards_partition_rows_with_balanced_tokens():
    lengths = torch.tensor([100, 1, 50, 49, 2, 98, 3, 60])
    shards = [shard_rows_for_data_parallel(lengths, r, 2) for r in range(2)]
    assert sorted(torch.cat(shards).tolist()) == list(range(8))
    tokens = [int(lengths[s].sum()) for s in shards]
    assert abs(tokens[0] - tokens[1]) <= int(lengths.max())
    assert abs(tokens[0] - tokens[1]) < 40  # round-robin dealing would give 59


def test_fewer_rows_than_data_parallel_ranks_leaves_later_ranks_empty():
    # Dynamic sampling can leave fewer rows than DP ranks: each row still goes to exactly one rank, the first ones.
    shards = [shard_rows_for_data_parallel(torch.tensor([3, 9]), r, 4).tolist() for r in range(4)]
    assert shards == [[1], [0], [], []]
    with pytest.raises(ValueError, match="outside data_parallel=4"):
        shard_rows_for_data_parallel(torch.tensor([3, 9]), 4, 4)


def test_slice_rows_cuts_only_per_token_fields():
    batch = {
        "input_ids": torch.arange(12).reshape(3, 4),
        "step_ends": torch.tensor([[0, 1], [2, 3], [1, -1]]),
        "reward": torch.tensor([1.0, 2.0, 3.0]),
    }
    out = slice_rows(batch, torch.tensor([2, 0]), 3)
    assert out["input_ids"].tolist() == [[8, 9, 10], [0, 1, 2]]
    assert out["step_ends"].tolist() == [[1, -1], [0, 1]]
    assert out["reward"].tolist() == [3.0, 1.0]


@pytest.mark.parametrize("dp_size, rows", [(2, 7), (4, 9), (3, 2)])
def test_aligned_micro_batches_have_one_shape_per_index_on_every_rank_and_each_row_once(dp_size, rows):
    from grpo_mega.engine.batching import PADDING_ROW, aligned_rank_micro_batches

    generator = torch.Generator().manual_seed(rows)
    lengths = torch.randint(3, 20, (rows,), generator=generator)
    batch = {"input_ids": torch.randint(0, 50, (rows, 20), generator=generator),
             "attention_mask": (torch.arange(20) < lengths[:, None]).long(),
             "loss_mask": (torch.arange(20) < lengths[:, None]).long(), "advantages": torch.randn(rows, 1)}
    ranks = [aligned_rank_micro_batches(batch, 24, rank, dp_size)[0] for rank in range(dp_size)]
    assert len({len(micro_batches) for micro_batches in ranks}) == 1  # lockstep: as many on every rank
    for index in range(len(ranks[0])):  # one shape per index: the dispatcher gathers equal token counts
        assert len({tuple(micros[index]["input_ids"].shape) for micros in ranks}) == 1
    seen = []
    for micro_batches in ranks:
        for micro in micro_batches:
            padding = micro["row_index"] == PADDING_ROW
            assert micro["loss_mask"][padding].sum() == 0  # padding rows add nothing to any loss
            for row, index in zip(micro["input_ids"][~padding], micro["row_index"][~padding].tolist()):
                assert torch.equal(row, batch["input_ids"][index, : row.shape[0]])
                seen.append(index)
    assert sorted(seen) == list(range(rows))  # every real row exactly once
    assert batch["loss_mask"].sum() == lengths.sum()  # the batch itself untouched
