"""Peak memory of the log-prob path (forward + backward) is bounded by chunk_size x V/tp, not by
tokens x V.

Measured as the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) in a fresh
spawned process whose malloc returns every freed buffer of 64 KiB or more to the OS at once, so the
resident set follows live tensor memory; torch's CPU allocations are invisible to tracemalloc.
Sizes are chosen so that the quantities compared differ by far more than allocator noise.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

HIDDEN = 64
VOCAB = 32768
MIB = 2**20
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _peak_bytes_of_logprob_path(tokens: int, vocab: int, chunk_size: int) -> int:
    """Peak resident growth while computing log-probs and entropy and back-propagating."""
    from grpo_mega.model import vocab_parallel_logprobs_and_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).requires_grad_()
    weight = (0.1 * torch.randn(vocab, HIDDEN, generator=generator)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current resident set
    baseline = _resident_kib("VmRSS")
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(
        hidden, weight, labels, vocab_size=vocab, chunk_size=chunk_size
    )
    (logprobs.sum() + entropy.sum()).backward()
    peak = _resident_kib("VmHWM") - baseline
    assert torch.isfinite(hidden.grad).all() and weight.grad.abs().sum() > 0
    return peak * 1024


def _measure(configs: list[tuple[int, int, int]]) -> dict:
    from grpo_mega.parallel import init_distributed

    if ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    init_distributed(1, 1, seed=0, device="cpu")
    _peak_bytes_of_logprob_path(
        256, VOCAB, 64
    )  # warm-up: first-call allocations are not the path's
    return {config: _peak_bytes_of_logprob_path(*config) for config in configs}


SMALL_CHUNK, LARGE_CHUNK = 64, 512
FEW_TOKENS, MANY_TOKENS = 1024, 4096


@pytest.fixture(scope="module")
def peaks():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident set")
    configs = [
        (FEW_TOKENS, VOCAB, SMALL_CHUNK),
        (MANY_TOKENS, VOCAB, SMALL_CHUNK),
        (FEW_TOKENS, VOCAB, LARGE_CHUNK),
        (FEW_TOKENS, 2 * VOCAB, SMALL_CHUNK),
        (FEW_TOKENS, VOCAB, FEW_TOKENS),  # one chunk: the unchunked computation
    ]
    (measured,) = run_distributed(_measure, 1, configs)
    for (tokens, vocab, chunk), peak in measured.items():
        print(f"tokens={tokens} vocab={vocab} chunk={chunk}: peak {peak / MIB:.1f} MiB")
    return measured


def _bound(tokens: int, vocab: int, chunk: int) -> float:
    """Allowed peak: 3 [chunk, V] fp32 buffers (2 live + BLAS packing), 2 weight-sized and 2
    hidden-sized buffers, 4 MiB slack."""
    return 4 * (3 * chunk * vocab + 2 * vocab * HIDDEN + 2 * tokens * HIDDEN) + 4 * MIB


def test_peak_is_bounded_by_chunk_size_not_tokens_times_vocab(peaks):
    for (tokens, vocab, chunk), peak in peaks.items():
        if chunk < tokens:
            assert peak <= _bound(tokens, vocab, chunk), (tokens, vocab, chunk)
    many = peaks[(MANY_TOKENS, VOCAB, SMALL_CHUNK)]
    assert many < MANY_TOKENS * VOCAB * 4 / 8  # an eighth of the unchunked logits alone


def test_peak_does_not_grow_with_tokens(peaks):
    few, many = peaks[(FEW_TOKENS, VOCAB, SMALL_CHUNK)], peaks[(MANY_TOKENS, VOCAB, SMALL_CHUNK)]
    # 4x the tokens adds only the [tokens, H] gradient buffers (0.75 MiB each here).
    assert many - few < 4 * MIB


def test_peak_grows_with_chunk_size_and_vocabulary(peaks):
    small = peaks[(FEW_TOKENS, VOCAB, SMALL_CHUNK)]
    # The measurement sees chunk-sized buffers: one more [chunk, V] fp32 buffer at least.
    assert peaks[(FEW_TOKENS, VOCAB, LARGE_CHUNK)] > small + (LARGE_CHUNK - SMALL_CHUNK) * VOCAB * 4
    assert peaks[(FEW_TOKENS, 2 * VOCAB, SMALL_CHUNK)] > small + SMALL_CHUNK * VOCAB * 4
    # One chunk of all tokens holds at least the full [tokens, V] logits.
    assert peaks[(FEW_TOKENS, VOCAB, FEW_TOKENS)] > FEW_TOKENS * VOCAB * 4
