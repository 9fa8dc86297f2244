"""This rank's random number generator states, captured for a checkpoint and restored on resume.

Exact resume needs every stream a training step may draw from: Python's ``random``, NumPy's global
generator, torch's CPU generator, the CUDA generator of this rank's device (when there is one) and
megatron's model-parallel RNG tracker (dropout inside tensor-parallel regions draws from per-TP-rank
streams). The states are kept as builtins and tensors only, so the checkpoint loads with
``torch.load(weights_only=True)``, which megatron's dist_checkpointing uses.

The states belong to one (TP, PP, DP) rank: restoring them is only meaningful at the layout they were
saved at (the training checkpoint checks that and reseeds otherwise).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch
from megatron.core import tensor_parallel

RNG_STATE_KEYS = ("python", "numpy", "torch_cpu", "torch_cuda", "megatron_tracker")


def capture_rng_state() -> dict[str, Any]:
    """Copy of this rank's generator states: {python, numpy, torch_cpu, torch_cuda, megatron_tracker}.

    ``torch_cuda`` is None without CUDA. NumPy's MT19937 key array is stored as an int64 tensor.
    """
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss),
                  float(cached_gaussian)),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        # The tracker replaces (not mutates) its state tensors, but a clone keeps the capture immune anyway.
        "megatron_tracker": {
            name: state.clone() for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator of this rank to a :func:`capture_rng_state` result.

    Raises ValueError when a stream is missing, or when the state holds a CUDA generator state and
    this process has no CUDA (or the other way round): the streams would silently diverge.
    """
    missing = [key for key in RNG_STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}; expected keys {RNG_STATE_KEYS}")
    saved_cuda = state["torch_cuda"] is not None
    if saved_cuda != torch.cuda.is_available():
        raise ValueError(
            f"RNG state was saved {'with' if saved_cuda else 'without'} CUDA, but this process "
            f"{'has' if torch.cuda.is_available() else 'has no'} CUDA: the streams cannot be restored"
        )
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {name: tensor.clone() for name, tensor in state["megatron_tracker"].items()}
    )
    if saved_cuda:
        torch.cuda.set_rng_state(state["torch_cuda"])
    torch.set_rng_state(state["torch_cpu"])


@contextlib.contextmanager
def rng_state_kept() -> Iterator[None]:
    """Every generator of this rank as it was before the block, after it: for set-up that runs after a resume has
    restored them (building the rollout engine, the PRM scorer, a first evaluation). Such set-up draws from them (a
    model's random initialisation before its weights are loaded), and it runs with the restored states in a
    resumed run but before step 1 in an uninterrupted one: the checkpoints of the two would then differ by those
    draws (measured by bench/chaos.py: torch's CPU generator), and so would anything that samples from them later
    (dropout)."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
