"""A static KV cache for the hf engine's decode loop: fixed shapes per batch-size bucket, so that one decode step can
be captured as a CUDA graph (``grpo_mega.rollout.decode_graphs``) or compiled with ``torch.compile`` and replayed.

Why a static cache. The eager decode step of a 0.5B model is launch-bound on a GPU (hundreds of small kernels, each
launched by Python); a CUDA graph replays them all with one launch, but only over the same buffers with the same
shapes. The loop's own cache (``kv_cache.PreallocatedLayer``) grows its views by one column per step and the batch
shrinks as rows end (``hf_decode``'s compaction): neither shape is fixed. Here every layer's keys and values are one
buffer ``[max rows, kv heads, capacity, head dim]``; a step writes column ``c`` of every row (``index_copy_`` at a
device tensor, so the graph stays valid as ``c`` moves) and attends to all ``capacity`` columns through a boolean
mask in which the columns not written yet are False. The step's inputs (ids, positions, the mask, the column) are
static buffers too, filled before each replay.

Rows that end. A graph has a fixed batch, so a row that ends stays in the batch, fed padding and masked out of the
result as in the eager loop, until the rows still running fit a smaller *bucket* (nano-vllm's sizes: 1, 2, 4, 8,
then every 16); the batch then moves to that bucket: the running rows are gathered to the front of the buffers (one
copy of their cache, as a compaction copies today) and the bucket's graph (views ``buffer[:bucket]``) runs from
there. Moving only between buckets keeps the graphs few (one capture each, shared memory pool) where compacting at
every quarter (today's rule) would need a graph per batch size.

Arithmetic. The prefill (the call's first step) runs eagerly into the loop's usual cache and is copied into the
buffers; the decode steps then attend over ``capacity`` columns, the unwritten ones masked (a masked column's
weight is exactly 0, but the reduction order differs from attention over the written columns only), and run at the
bucket's batch size instead of the live rows' (a matmul's blocking, hence its rounding, may depend on the batch).
Tokens and log-probs are therefore today's up to float rounding: equal greedy tokens and samples at a seed unless
two candidates are within rounding of each other (float32 on the CPU: tests/test_rollout_static_decode.py; bf16 on
a GPU: ``bench/gpu_check_graphs.py`` records the share of rows whose tokens match).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MODES = ("off", "static", "static_compile", "cuda_graphs")
"""``rollout.decode_graphs``: today's loop; the static cache run eagerly (any device: the reference the others are
tested against); the static cache's step compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA); the static
cache's step captured as one CUDA graph per bucket (CUDA)."""

CUDA_ONLY_MODES = ("static_compile", "cuda_graphs")

CAPACITY_MULTIPLE = 64
"""Cache columns are allocated in multiples of this, so that calls whose prompts differ by a few tokens reuse the
buffers (and the graphs captured over them)."""


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """The batch sizes a static decode runs at for calls of up to ``max_rows`` rows: 1, 2, 4, 8, then every 16 up to
    ``max_rows`` rounded up to a multiple of 16 (nano-vllm's buckets)."""
    if max_rows < 1:
        raise ValueError(f"bucket_sizes: max_rows must be >= 1, got {max_rows}")
    sizes = []
    for size in (1, 2, 4, 8):
        sizes.append(size)
        if size >= max_rows:
            return tuple(sizes)
    return tuple(sizes) + tuple(range(16, capacity_for(max_rows, 16) + 1, 16))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``rows`` rows."""
    for size in buckets:
        if size >= rows:
            return size
    raise ValueError(f"bucket_for: {rows} rows exceed the largest bucket {buckets[-1]}")


def capacity_for(columns: int, multiple: int = CAPACITY_MULTIPLE) -> int:
    """``columns`` rounded up to a multiple of ``multiple``."""
    return -(-columns // multiple) * multiple


class StaticKVLayer(CacheLayerMixin):
    """One layer's keys and values ``[bucket, kv heads, capacity, head dim]`` (views of the decoder's buffers); an
    update writes the step's one position at the column held in the shared device tensor ``column`` ([1] long)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the buffers exist from the start
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


StepFn = Callable[[int], torch.Tensor]
"""bucket -> [bucket, vocab] logits of one decode step over the decoder's buffers."""


class StaticDecoder:
    """The static buffers of the decode loop (kept across calls while they are large enough) and the way its step
    runs: ``runner(eager_step)`` wraps the eager step (``None``: eager; ``decode_graphs.runner_for`` builds the CUDA
    graph and compile runners). ``shrinks``: whether the batch moves to smaller buckets as rows end (a compiled step
    recompiles per shape, so ``static_compile`` keeps its first bucket)."""

    def __init__(self, model: torch.nn.Module, *, runner: Callable[[StepFn], StepFn] | None = None,
                 shrinks: bool = True):
        self.model = model
        self.shrinks_batch = shrinks
        self._wrap = runner
        self.rows = self.capacity = 0  # allocated rows (the largest bucket) and columns
        self.buckets: tuple[int, ...] = ()
        self.step_fn: StepFn | None = None
        self.cache: Cache | None = None  # the current bucket's views, for ``kv_cache.take_row_cache``
        self._caches: dict[int, Cache] = {}
        self.bucket = 0

    # ----------------------------------------------------------------------------------------------- buffers

    def begin(self, cache, rows: int, length: int, max_new_tokens: int, prompt_mask: torch.Tensor | None) -> None:
        """Start a call of ``rows`` rows whose first ``length`` columns the prefill wrote into ``cache`` (the loop's
        dynamic cache, after its first step): (re)allocate the buffers when they are too small, copy the prefill's
        keys and values in, and set the mask to ``prompt_mask`` ([rows, length], None: all real)."""
        layers = cache.layers
        sample = layers[0].keys
        if sample.shape[0] != rows or sample.shape[-2] != length:
            raise RuntimeError(f"StaticDecoder.begin: a prefill cache of {tuple(sample.shape)} for {rows} rows x "
                               f"{length} columns")
        needed_rows, needed_columns = bucket_sizes(rows)[-1], length + max_new_tokens
        if (needed_rows > self.rows or needed_columns > self.capacity or len(layers) != len(self.keys)
                or sample.dtype != self.keys[0].dtype or sample.device != self.keys[0].device):
            self._allocate(layers, needed_rows, capacity_for(needed_columns))
        for layer, keys, values in zip(layers, self.keys, self.values):
            keys[:rows, :, :length].copy_(layer.keys)
            values[:rows, :, :length].copy_(layer.values)
        self.mask.fill_(False)
        if prompt_mask is None:
            self.mask[:rows, 0, 0, :length] = True
        else:
            self.mask[:rows, 0, 0, :length] = prompt_mask.bool()
        self._use_bucket(self.rows if not self.shrinks_batch else bucket_for(rows, self.buckets))

    def _allocate(self, layers, rows: int, capacity: int) -> None:
        device = layers[0].keys.device
        self.rows, self.capacity, self.buckets = rows, capacity, bucket_sizes(rows)
        self._caches = {}
        self.keys = [layer.keys.new_zeros(rows, layer.keys.shape[1], capacity, layer.keys.shape[-1])
                     for layer in layers]
        self.values = [layer.values.new_zeros(rows, layer.values.shape[1], capacity, layer.values.shape[-1])
                       for layer in layers]
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, 1, capacity, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        if self._wrap is not None:  # graphs and compiled code bind the buffers: new buffers, new ones
            self._mark_static()
        self.step_fn = self._eager_step if self._wrap is None else self._wrap(self._eager_step)

    def _mark_static(self) -> None:
        """Tell torch.compile that the buffers keep their addresses (else its CUDA graphs copy or skip them)."""
        for tensor in [*self.keys, *self.values, self.ids, self.positions, self.mask, self.column]:
            torch._dynamo.mark_static_address(tensor)

    def _view(self, tensor: torch.Tensor, bucket: int) -> torch.Tensor:
        """The first ``bucket`` rows of a buffer (the buffer itself at the largest: compiled code sees the tensor
        whose address was marked static)."""
        return tensor if bucket == self.rows else tensor[:bucket]

    def _bucket_cache(self, bucket: int) -> Cache:
        cache = self._caches.get(bucket)
        if cache is None:
            cache = Cache(layers=[StaticKVLayer(self._view(k, bucket), self._view(v, bucket), self.column)
                                  for k, v in zip(self.keys, self.values)])
            self._caches[bucket] = cache
        return cache

    def _use_bucket(self, bucket: int) -> None:
        self.bucket = bucket
        self.cache = self._bucket_cache(bucket)

    # ------------------------------------------------------------------------------------------------ steps

    def _eager_step(self, bucket: int) -> torch.Tensor:
        """[bucket, vocab] logits of the step whose inputs are in the buffers (what the graphs capture)."""
        return self.model(input_ids=self._view(self.ids, bucket), attention_mask=self._view(self.mask, bucket),
                          position_ids=self._view(self.positions, bucket), past_key_values=self._bucket_cache(bucket),
                          use_cache=True, logits_to_keep=1).logits[:, -1, :]

    def step(self, step_input: torch.Tensor, step_positions: torch.Tensor, column: int) -> torch.Tensor:
        """[rows, vocab] float32 logits of one decode step: ``step_input`` / ``step_positions`` ([rows, 1], the batch
        rows at the front of the buffers) fed at cache ``column``. Four small copies, then the step (no host read)."""
        rows = step_input.shape[0]
        self.ids[:rows].copy_(step_input)
        self.positions[:rows].copy_(step_positions)
        self.column.fill_(column)
        self.mask[:, 0, 0, column].fill_(True)
        return self.step_fn(self.bucket)[:rows].float()

    def wants_shrink(self, running: int) -> bool:
        """Whether ``running`` rows fit a smaller bucket than the current one (then :meth:`select`)."""
        return self.shrinks_batch and bucket_for(max(running, 1), self.buckets) < self.bucket

    def select(self, kept_rows: torch.Tensor, count: int) -> None:
        """Keep the batch rows ``kept_rows`` (``count`` of them, on the device), gathered to the front of the
        buffers, and move to the bucket that holds them."""
        for buffer in [*self.keys, *self.values, self.mask]:
            buffer[:count].copy_(buffer.index_select(0, kept_rows))
        self._use_bucket(bucket_for(max(count, 1), self.buckets) if self.shrinks_batch else self.rows)
