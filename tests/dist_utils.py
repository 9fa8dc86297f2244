"""Multi-process test helpers: spawn gloo workers, and give every layout the same weights.

`run_distributed(fn, world_size, *args)` starts `world_size` fresh processes the way torchrun would
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment), runs `fn(*args)` in
each and returns the list of their return values, indexed by rank. A worker's exception is raised
again in the test process with the worker's traceback; a hang fails after `timeout` seconds.

Identical weights at any layout: `save_reference_weights` builds the model at TP=1/PP=1 from a seed
and saves it with megatron dist_checkpointing; `load_reference_weights` loads that checkpoint into a
model built at another TP/PP layout (dist_checkpointing reshards, the SwiGLU fc1 layout included).

Tiny models: `tiny_qwen2(**overrides)` is the one hand-built Qwen2 config of the single-process tests (the rollout
engine, its decode loops and caches); `tiny_qwen2_config` is the multi-process tests' wider one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo_mega.run.launcher import spawn_local_ranks

# Spawned interpreters import torch and megatron from scratch (about 5-10 s), so the default is
# generous; a deadlocked collective still fails the test instead of blocking CI forever.
DEFAULT_TIMEOUT_S = 300.0


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh spawned processes (one intra-op thread each: the cores are
    shared by all ranks) and return their results by rank.

    `fn` must be importable by name (a module-level function) and its result picklable. If a
    worker raises, the first failure is raised here as
    `torch.multiprocessing.ProcessRaisedException` carrying the worker's traceback, and the other
    workers are terminated. If the workers have not all finished after `timeout` seconds, they are
    killed and `TimeoutError` is raised.
    """
    return spawn_local_ranks(fn, world_size, args, threads=1, timeout=timeout)


# The rollout tests' shape: 2 layers, hidden 32, MLP 64, 4 heads over 2 KV groups (GQA), a few ms a forward on a CPU.
TINY_QWEN2_SHAPE = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2)


def tiny_qwen2(*, vocab_size: int, **overrides):
    """A Qwen2 config of ``TINY_QWEN2_SHAPE`` with the test's ``vocab_size`` (no default: the default 151,936 rows
    would be most of such a model) and ``overrides`` (any Qwen2Config field, the shape's included); every field not
    named is Qwen2Config's default."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY_QWEN2_SHAPE, "vocab_size": vocab_size, **overrides})


def tiny_qwen2_config(*, tied: bool, vocab_size: int = 301, num_layers: int = 4):
    """A Qwen2-shaped config small enough for CPU tests: hidden 64, 4 heads, 2 KV groups.

    vocab_size is odd on purpose so that TP padding rows exist; initializer_range 0.2 spreads the
    logits (near-uniform distributions would hide errors in log-prob comparisons).
    """
    return tiny_qwen2(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.2,
                      tie_word_embeddings=tied)


def right_padded_rows(seed: int, lengths=(12, 5, 9, 7, 12), *, width: int = 12, vocab_size: int = 301,
                      prompt_tokens: int = 3) -> dict:
    """Rows of random token ids (``seed``), right-padded to ``width`` after ``lengths`` real tokens: input_ids,
    attention_mask and a loss_mask that leaves out a ``prompt_tokens``-token prompt."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    input_ids = torch.randint(0, vocab_size, (len(lengths), width), generator=generator)
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :prompt_tokens] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def build_model_for_layout(hf_config):
    """Build this rank's stage of `hf_config` at megatron's current TP/PP layout."""
    from megatron.core import parallel_state

    from grpo_mega.model import build_gpt_model, gpt_config_from_hf

    config = gpt_config_from_hf(
        hf_config,
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    return build_gpt_model(config)


def save_reference_weights(hf_config, checkpoint_dir: str | Path, seed: int):
    """Build `hf_config` at TP=1/PP=1 with seeded weights, save it with dist_checkpointing.

    Returns the model.

    Every parameter gets seeded noise on top of megatron's initialisation, so norm weights and qkv
    biases differ from their trivial initial values (1 and 0). Call on every rank of a world
    initialised at TP=1/PP=1 (DP ranks save one deduplicated copy).
    """
    import megatron.core.dist_checkpointing as dist_checkpointing
    from megatron.core import parallel_state

    if (
        parallel_state.get_tensor_model_parallel_world_size() != 1
        or parallel_state.get_pipeline_model_parallel_world_size() != 1
    ):
        raise ValueError("reference weights are built at TP=1/PP=1")
    model = build_model_for_layout(hf_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(checkpoint_dir))
    return model


def load_reference_weights(hf_config, checkpoint_dir: str | Path):
    """Build `hf_config` at the current TP/PP layout and load a `save_reference_weights` checkpoint.

    dist_checkpointing reshards the TP=1/PP=1 tensors into this rank's shards (QKV and SwiGLU fc1
    layouts included).
    """
    import megatron.core.dist_checkpointing as dist_checkpointing

    model = build_model_for_layout(hf_config)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint_dir))
    model.load_state_dict(state)
    return model
