"""The hf rollout engine's generate calls: prompts grouped by length so that common lengths need no padding."""

import pytest

from grpo_mega.rollout.hf_engine import length_batches


def test_common_lengths_get_unpadded_calls_rare_lengths_join_the_next():
    # lengths by index: 5 x length 3 (indices 0-4), 1 x length 4 (5), 2 x length 6 (6, 7), 3 x length 2 (8-10)
    lengths = [3, 3, 3, 3, 3, 4, 6, 6, 2, 2, 2]
    # min_bucket 3: [2,2,2] and [3,3,3,3,3] are complete calls; 4 alone is too few and joins the 6s (padded)
    assert length_batches(lengths, batch_size=8, min_bucket=3) == [[8, 9, 10], [0, 1, 2, 3, 4], [5, 6, 7]]
    # batch_size caps a call inside a run of one length
    assert length_batches(lengths, batch_size=2, min_bucket=3) == [[8, 9], [10, 0], [1, 2], [3, 4], [5, 6], [7]]
    # min_bucket larger than the batch: one padded call per batch_size, shortest first
    assert length_batches(lengths, batch_size=11, min_bucket=100) == [[8, 9, 10, 0, 1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("batch_size,min_bucket", [(1, 1), (4, 2), (64, 8)])
def test_every_prompt_exactly_once(batch_size, min_bucket):
    lengths = [(i * 7) % 5 + 1 for i in range(23)]
    batches = length_batches(lengths, batch_size, min_bucket)
    assert sorted(i for b in batches for i in b) == list(range(23))
    assert all(1 <= len(b) <= batch_size for b in batches)
