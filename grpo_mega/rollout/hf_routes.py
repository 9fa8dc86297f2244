"""The hf engine's form of routing replay (``rollout.routing_replay``): the experts each token of a finished
sequence is routed to, from one teacher-forced forward pass of the transformers model with
``output_router_logits=True``.

Each MoE layer's router logits give the token's experts as the router chooses them: transformers' Qwen3-MoE router
(``Qwen3MoeTopKRouter``) takes the top-k of ``softmax(logits)`` in fp32, and so does :func:`top_experts`. These are
the hf engine's routing of the finished sequence: the same weights and the same numerics as its decode, which
routed the same tokens with a KV cache (equal up to the cache's arithmetic: a near-tie may fall the other way).
vLLM instead returns the routes its decode took (``grpo_mega.rollout.vllm_engine``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def top_experts(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """[tokens, topk] expert ids of router logits [tokens, experts]: the top-k of the fp32 softmax (monotone, so
    the top-k of the logits up to ties), largest first, as transformers' Qwen3-MoE router selects them."""
    return torch.softmax(router_logits, dim=-1, dtype=torch.float32).topk(topk, dim=-1).indices


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type that holds every expert id (vLLM's choice: uint8 up to 256 experts)."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


@torch.no_grad()
def routed_experts(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, pad_token_id: int,
                   batch_size: int) -> list[np.ndarray]:
    """For each token sequence (prompt + response), the experts of its first ``len - 1`` tokens in every MoE
    layer: an array [len - 1, layers, top-k] (the last token, never put through the model when sampling, has no
    row, as in vLLM's). ``model``: a transformers MoE causal LM whose config has ``num_experts`` and
    ``num_experts_per_tok``; ``batch_size`` sequences per forward pass (right-padded, masked)."""
    config = model.config
    topk, dtype = config.num_experts_per_tok, route_dtype(config.num_experts)
    device = next(model.parameters()).device
    decoder = model.base_model  # the layers without the LM head: its logits are not needed
    out: list[np.ndarray] = []
    for start in range(0, len(sequences), batch_size):
        chunk = [list(ids) for ids in sequences[start:start + batch_size]]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, ids in enumerate(chunk):
            input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, :len(ids)] = 1
        output = decoder(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False,
                         output_router_logits=True)
        if not output.router_logits:
            raise RuntimeError(f"{type(model).__name__} returned no router logits: routing replay needs a "
                               "mixture-of-experts model")
        # each layer's logits are [rows * width, experts], row-major over (row, position)
        layers = torch.stack([top_experts(logits, topk).view(len(chunk), width, topk)
                              for logits in output.router_logits], dim=2)  # [rows, width, layers, topk]
        layers = layers.cpu().numpy().astype(dtype)
        out.extend(layers[row, :len(ids) - 1].copy() for row, ids in enumerate(chunk))
    return out
