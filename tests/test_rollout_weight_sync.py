"""Bucketed weight streaming: bucket bounds, order, laziness, and the begin/update/finish protocol."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_mega.rollout.weight_sync import iter_buckets, sync_weights, tensor_bytes


def named(sizes):
    """(name, float32 tensor of `size` elements) for each size; 4 bytes per element."""
    return [(f"w{i}", torch.zeros(size)) for i, size in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=25), bucket_bytes=st.integers(1, 120))
def test_buckets_keep_order_and_stay_within_bound(sizes, bucket_bytes):
    tensors = named(sizes)
    buckets = list(iter_buckets(iter(tensors), bucket_bytes))
    assert [n for bucket in buckets for n, _ in bucket] == [n for n, _ in tensors]
    for bucket in buckets:
        assert bucket
        total = sum(tensor_bytes(t) for _, t in bucket)
        assert total <= bucket_bytes or len(bucket) == 1  # only a lone tensor may exceed the bound
    for first, second in zip(buckets, buckets[1:]):  # greedy: the next tensor did not fit
        assert sum(tensor_bytes(t) for _, t in first) + tensor_bytes(second[0][1]) > bucket_bytes


def test_oversized_tensor_goes_alone_and_source_is_pulled_lazily():
    pulled = []

    def source():
        for name, tensor in named([2, 2, 100, 1, 1]):
            pulled.append(name)
            yield name, tensor

    buckets = iter_buckets(source(), bucket_bytes=16)
    assert [n for n, _ in next(buckets)] == ["w0", "w1"]
    assert pulled == ["w0", "w1", "w2"]  # one tensor of look-ahead, never the whole model
    assert [n for n, _ in next(buckets)] == ["w2"]
    assert [n for n, _ in next(buckets)] == ["w3", "w4"]
    assert next(buckets, None) is None


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named([1]), 0))


class RecordingEngine:
    """Records the weight-update calls a sync makes (the hf engine test covers real loading)."""

    def __init__(self):
        self.calls = []

    def begin_weight_update(self):
        self.calls.append("begin")

    def update_weights(self, named_tensors):
        self.calls.append([name for name, _ in named_tensors])

    def finish_weight_update(self):
        self.calls.append("finish")

    def generate(self, prompt_ids, sampling):
        raise AssertionError("not used")


def test_sync_weights_streams_buckets_between_begin_and_finish():
    engine = RecordingEngine()
    stats = sync_weights(iter(named([3, 3, 3, 10])), engine, bucket_bytes=24)
    assert engine.calls == ["begin", ["w0", "w1"], ["w2"], ["w3"], "finish"]
    assert (stats.num_tensors, stats.num_buckets, stats.bytes) == (4, 3, 76)
    assert stats.seconds >= 0


def test_sync_weights_failure_skips_finish():
    engine = RecordingEngine()

    def broken_source():
        yield "w0", torch.zeros(1)
        raise OSError("gather failed")

    with pytest.raises(OSError, match="gather failed"):
        sync_weights(broken_source(), engine, bucket_bytes=1024)
    assert engine.calls == ["begin"]
