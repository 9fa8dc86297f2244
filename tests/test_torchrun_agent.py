"""grpo_mega.run.torchrun's changes to torchrun's agent that only make it cheaper: the same results, less CPU."""

from __future__ import annotations

import inspect

import pytest


def test_rendezvous_events_get_their_caller_s_name_without_a_walk_of_the_stack(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from grpo_mega.run.torchrun import _name_rendezvous_events_cheaply

    original = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)  # put back after the test
    _name_rendezvous_events_cheaply()
    cheap = dynamic_rendezvous.get_method_name
    assert cheap is not original

    def _record(name_of):  # as the rendezvous's _record calls it: depth 2 is the method that records
        return name_of()

    def join_rendezvous():
        return _record(original), _record(cheap)

    assert join_rendezvous() == ("join_rendezvous", "join_rendezvous")
    for depth in (0, 1, 3, 100_000):  # 100,000 frames up: none there
        assert cheap(depth) == original(depth)
    assert cheap(100_000) == "no_method_name"

    def no_stack_walk(*args, **kwargs):
        raise AssertionError("inspect.stack() called")

    def close():
        return _record(cheap)

    monkeypatch.setattr(inspect, "stack", no_stack_walk)
    assert close() == "close"
    with pytest.raises(AssertionError, match="inspect.stack"):
        original()
