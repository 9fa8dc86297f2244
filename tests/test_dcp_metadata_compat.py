"""megatron-core's torch_dist metadata reader beside torch >= 2.15 (grpo_mega/checkpoint/dcp_metadata_compat.py):
torch 2.15 records ``strides`` in a stored tensor's properties, which megatron passes on to ``torch.empty``. Run in
one process on a checkpoint written by torch.distributed.checkpoint itself (no process group)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def stored(tmp_path):
    import torch.distributed.checkpoint as dcp

    tensors = {"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.save(tensors, checkpoint_id=str(tmp_path), no_dist=True)
    return tmp_path, tensors


def test_megatron_reads_the_tensor_list_of_a_checkpoint_with_this_torch(stored, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import torch as megatron_dcp

    from grpo_mega.checkpoint import dcp_metadata_compat

    monkeypatch.setattr(megatron_dcp, "torch", megatron_dcp.torch)  # the view goes with the test
    dcp_metadata_compat.apply()
    path, tensors = stored
    found = megatron_dcp.TorchDistLoadShardedStrategy().load_tensors_metadata(path)
    assert set(found) == set(tensors)
    for key, tensor in tensors.items():
        assert (found[key].global_shape, found[key].dtype) == (tuple(tensor.shape), tensor.dtype), key


def test_the_view_is_there_exactly_when_torch_records_strides(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import torch as megatron_dcp

    from grpo_mega.checkpoint import dcp_metadata_compat

    monkeypatch.setattr(megatron_dcp, "torch", torch)
    dcp_metadata_compat.apply()
    dcp_metadata_compat.apply()  # idempotent
    viewed = megatron_dcp.torch is not torch
    assert viewed == dcp_metadata_compat.tensor_properties_have_strides()
    if viewed:
        meta = megatron_dcp.torch.empty((2, 3), dtype=torch.float32, strides=(3, 1), device="meta")
        assert meta.shape == (2, 3) and meta.is_meta


def test_a_megatron_whose_torch_was_replaced_elsewhere_is_refused(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import torch as megatron_dcp

    from grpo_mega.checkpoint import dcp_metadata_compat

    if not dcp_metadata_compat.tensor_properties_have_strides():
        pytest.skip("torch < 2.15: nothing to replace")
    monkeypatch.setattr(megatron_dcp, "torch", object())
    with pytest.raises(RuntimeError, match="does not use `torch` as expected"):
        dcp_metadata_compat.apply()
