"""Routing replay (``rollout.routing_replay``, verl's R3): the experts the rollout engine routed each token to are
replayed in the trainer's forward passes through megatron-core's ``router_replay``, so that the old log-probs and
the update route as the sampler did.

megatron-core 0.16 (``transformer/moe/router_replay.py``) gives every ``TopKRouter`` of a model built with
``moe_enable_routing_replay`` a ``RouterReplay``; with the action ``REPLAY_FORWARD`` its top-k is the target indices
set before the forward, and the routing probabilities are the router's own scores at those experts (softmax over
the k replayed logits for Qwen3-MoE), so the router's weights still get their gradient. Nothing in megatron sets
them: :class:`RouterReplayer` does, per micro-batch and per router of this pipeline stage, and clears them right
after the micro-batch's forward, so no route outlives it (the backward pass does not re-run the routers unless
``parallel.recompute=full``, which the config refuses with replay). Routers are driven one by one, not through
``RouterReplay``'s class-wide list, which holds the routers of every model of the process (a KL reference built
without replay has none, and routes on its own).

A router sees its stage's hidden states [S, B, H] flattened to rows ``s * B + b`` (sequence-major), with S this
tensor-parallel rank's slice under sequence parallelism (the sequence padded at its end to a multiple of TP,
``grpo_mega.model.gpt``), and a packed micro-batch (``grpo_mega.engine.shared_prefix``) as one row of packed
tokens. The batch carries the routes as ``routed_experts`` [B, L, layers, top-k] (``grpo_mega.data.batch``); layer
``n`` of the model (``router.layer_number``, 1-based, global over pipeline stages) reads column ``n - 1``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core import parallel_state as mpu

ROUTES_KEY = "routed_experts"
"""The batch field of the rollout's routes [B, L, layers, top-k]."""


def stage_routes(micro: dict[str, torch.Tensor], padding: int, tp_rank: int, tp_size: int,
                 sequence_parallel: bool) -> torch.Tensor:
    """The rows a router of this stage sees for ``micro``: [S_local * B, layers, top-k] int64, row ``s * B + b``.

    ``padding``: tokens the model appends to the sequence for sequence parallelism (they route to experts 0..k-1);
    with ``sequence_parallel`` this rank's contiguous slice of the padded sequence."""
    routes = micro[ROUTES_KEY]
    rows, width, layers, topk = routes.shape
    if "packed_source" in micro:  # one sequence of the packed tokens, each from its row position
        by_token = routes.reshape(rows * width, layers, topk).index_select(0, micro["packed_source"])[:, None]
    else:
        by_token = routes.transpose(0, 1)  # [S, B, layers, top-k]
    if padding:
        filler = torch.arange(topk, dtype=by_token.dtype, device=by_token.device)
        filler = filler.expand(padding, by_token.shape[1], layers, topk)
        by_token = torch.cat([by_token, filler])
    if sequence_parallel:
        length = by_token.shape[0]
        if length % tp_size:
            raise ValueError(f"a sequence of {length} tokens does not split over {tp_size} tensor-parallel ranks")
        share = length // tp_size
        by_token = by_token[tp_rank * share:(tp_rank + 1) * share]
    return by_token.reshape(-1, layers, topk).long()


class RouterReplayer:
    """The replaying routers of one pipeline stage, by layer number, and the context that sets their targets for
    one micro-batch's forward."""

    def __init__(self, stage: torch.nn.Module, config) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        if config.moe_router_fusion:
            raise ValueError("routing replay: moe_router_fusion computes the top-k in a fused kernel that bypasses "
                             "megatron's router replay; build the model with moe_router_fusion=False")
        self.replays = {router.layer_number: router.router_replay for router in stage.modules()
                        if isinstance(router, TopKRouter) and router.router_replay is not None}
        self.sequence_parallel = bool(config.sequence_parallel)
        self.num_layers = config.num_layers

    def check(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """ValueError for micro-batches without routes of this model's layers; run before the schedule, whose
        pipeline stages would otherwise wait for a stage that raised."""
        for micro in micro_batches:
            if ROUTES_KEY not in micro:
                raise ValueError(f"routing replay is on but the batch has no {ROUTES_KEY!r}: the rollout engine must "
                                 "return the experts of every token (rollout.routing_replay)")
            if micro[ROUTES_KEY].dim() != 4 or micro[ROUTES_KEY].shape[2] != self.num_layers:
                raise ValueError(f"{ROUTES_KEY} of shape {tuple(micro[ROUTES_KEY].shape)}: expected [rows, tokens, "
                                 f"{self.num_layers} layers, top-k]")

    @contextlib.contextmanager
    def replaying(self, micro: dict[str, torch.Tensor], padding: int) -> Iterator[None]:
        """Within the context every router of this stage routes ``micro``'s tokens to the rollout's experts
        (``micro`` passed :meth:`check`)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows = stage_routes(micro, padding, mpu.get_tensor_model_parallel_rank(),
                            mpu.get_tensor_model_parallel_world_size(), self.sequence_parallel)
        try:
            for layer_number, replay in self.replays.items():
                replay.clear_indices()  # also empties its backward list, which would grow with every target
                replay.set_target_indices(rows[:, layer_number - 1].contiguous())
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield
        finally:
            for replay in self.replays.values():
                replay.clear_indices()
                replay.clear_router_replay_action()
