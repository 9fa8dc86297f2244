"""The CUDA-only runners of the static decode step (``grpo_mega.rollout.static_decode``): ``cuda_graphs`` captures one
CUDA graph per batch-size bucket, ``static_compile`` compiles the step with ``torch.compile(mode="reduce-overhead")``
(inductor's kernels replayed by its own CUDA graphs). Neither can run on the CPU; ``bench/gpu_check_graphs.py``
exercises both against the eager loop on one GPU.

Capture (nano-vllm's recipe): the step runs ``CAPTURE_WARMUP`` times on a side stream (kernels' lazy
initialisation, cuBLAS workspaces), then once under ``torch.cuda.graph`` into a memory pool shared by every bucket's
graph; each graph reads the decoder's static buffers (ids, positions, mask, cache column, keys and values) and
writes its logits into its own output tensor, read before the next replay. A bucket is captured the first time a
call runs at it, largest first (the batch only shrinks within a call), so the smaller graphs reuse the pool. The
warm-up and the capture run the real step over the real buffers: what they write (the step's column of the cache)
is what the replay writes again. Weight updates copy into the parameters in place, so the graphs stay valid.
"""

from __future__ import annotations

import time

import torch

from grpo_mega.rollout.static_decode import CUDA_ONLY_MODES, MODES, StaticDecoder, StepFn

CAPTURE_WARMUP = 2
"""Eager runs of a bucket's step before its capture."""


class CudaGraphSteps:
    """``StepFn`` that replays one captured CUDA graph per bucket (captured at first use)."""

    def __init__(self, eager_step: StepFn):
        self.eager_step = eager_step
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        """Seconds spent capturing (warm-up included), summed over buckets."""

    def __call__(self, bucket: int) -> torch.Tensor:
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP):
                self.eager_step(bucket)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.eager_step(bucket)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start
        return graph, logits


class CompiledSteps:
    """``StepFn`` compiled by ``torch.compile`` (``mode``: ``reduce-overhead`` on CUDA; its CUDA graphs need the
    buffers' addresses marked static, which ``StaticDecoder`` does). One compilation per bucket and buffer set:
    ``static_compile`` keeps one bucket per allocation."""

    def __init__(self, eager_step: StepFn, *, mode: str | None = "reduce-overhead", backend: str = "inductor"):
        self.compiled = torch.compile(eager_step, mode=mode, backend=backend, dynamic=False)
        self.first_call_seconds: float | None = None
        """Seconds of the first call (the compilation, warm-up and capture)."""

    def __call__(self, bucket: int) -> torch.Tensor:
        if hasattr(torch, "compiler") and torch.cuda.is_available():
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten
        if self.first_call_seconds is None:
            start = time.perf_counter()
            logits = self.compiled(bucket).clone()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.first_call_seconds = time.perf_counter() - start
            return logits
        return self.compiled(bucket).clone()  # a copy: the graph's output buffer is reused by the next replay


def static_decoder_for(model: torch.nn.Module, mode: str, device: torch.device | str) -> StaticDecoder | None:
    """The decoder of ``rollout.decode_graphs`` = ``mode`` for ``model`` on ``device``; None for ``off``. ValueError
    (one line) for an unknown mode, a CUDA-only mode off CUDA, or a model the static cache cannot hold."""
    if mode not in MODES:
        raise ValueError(f"rollout.decode_graphs={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return None
    if mode in CUDA_ONLY_MODES and torch.device(device).type != "cuda":
        raise ValueError(f"rollout.decode_graphs={mode} needs a CUDA device (this engine runs on {device}); "
                         "'static' runs the same static cache eagerly anywhere")
    attention = getattr(model.config, "_attn_implementation", None)
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if attention != "sdpa" or layer_types != {"full_attention"}:
        raise ValueError(f"rollout.decode_graphs={mode} needs every layer full attention through SDPA "
                         f"(this model: {attention}, {sorted(layer_types)})")
    if mode == "static":
        return StaticDecoder(model)
    if mode == "cuda_graphs":
        return StaticDecoder(model, runner=CudaGraphSteps)
    return StaticDecoder(model, runner=CompiledSteps, shrinks=False)
