"""Set-up that runs after a resume restored the generators must leave them as they were (``rng_state_kept``): the
GRPO trainer builds its rollout engine and PRM scorer there, and a model's random initialisation draws from torch's
CPU generator; without it a resumed run's streams drifted from an uninterrupted run's (found by bench/chaos.py)."""

import random

import numpy as np
import torch

from grpo_mega.checkpoint.rng import rng_state_kept


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_building_a_model_inside_the_block_leaves_every_stream_where_it_was():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = _draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with rng_state_kept():
        torch.nn.Linear(64, 64)  # its initialisation draws from torch's CPU generator
        random.random(), np.random.rand()
    assert _draws() == expected


def test_without_it_the_same_build_moves_torch_s_generator():
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    torch.nn.Linear(64, 64)
    assert not torch.equal(torch.rand(3), expected)


def test_the_streams_are_restored_when_the_block_raises():
    torch.manual_seed(2)
    expected = torch.rand(3)
    torch.manual_seed(2)
    try:
        with rng_state_kept():
            torch.rand(5)
            raise RuntimeError("set-up failed")
    except RuntimeError:
        pass
    assert torch.equal(torch.rand(3), expected)
