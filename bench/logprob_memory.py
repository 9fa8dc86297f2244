"""Peak memory of per-token log-probs against vocabulary size: the trainer's chunked log-prob path against the
naive log_softmax over the full logits.

``chunked`` is what the policy's LM head runs (``grpo_mega.model.vocab_parallel_logprobs_and_entropy``, TP=1,
``model.logprob_chunk_size`` tokens of logits at a time, the backward recomputing them); ``full`` is the naive
computation (:func:`full_logprobs_and_entropy`: logits of all tokens, ``log_softmax``, gather, the entropy without
gradient since the loss does not use it by default). Both return the log-prob of every label and the entropy of
every position. Two modes: ``logprobs``, without gradient (the old-policy and reference passes), and ``train``,
forward and backward of a loss on the log-probs (the update).

Every (vocabulary, implementation, mode) runs in a fresh process (2 threads): inputs built (hidden states
[tokens, hidden], output matrix [vocab, hidden], labels), one small warm-up call, then the peak resident set is
reset (``/proc/self/clear_refs``) and the measured call made; reported is the peak over the resident set just
before the call (its outputs and, in ``train``, the gradients of the inputs included), with malloc returning
every freed buffer of 64 KiB or more at once so the resident set follows live tensors. A point whose naive
computation would need more than ``--memory-fraction`` of the available memory (estimated at 4 logits buffers)
is skipped and recorded as skipped. Prints the table and writes the JSON record (path printed last).

    python bench/logprob_memory.py            # vocab 8192, 32768, 151936; 4096 tokens; about 2 min on 2 idle cores
    python bench/logprob_memory.py --quick    # 1024 tokens
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from report import build_record, load_average, text_table, write_record  # noqa: E402

VOCABS = (8192, 32768, 151936)  # 151936: Qwen2 / Qwen2.5's padded vocabulary
IMPLEMENTATIONS = ("full", "chunked")
MODES = ("logprobs", "train")
MIB = 2**20
FP32_BYTES = 4
NAIVE_BUFFERS = 4  # logits, log_softmax and, in train, their two gradients: the naive path's [tokens, vocab] peak
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def full_logprobs_and_entropy(hidden, weight, labels):
    """Naive per-token log p(label) and entropy over the full [tokens, vocab] logits h W^T (fp32)."""
    import torch

    log_p = torch.log_softmax(hidden @ weight.t(), dim=-1)
    picked = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return picked, entropy


def logits_mib(tokens: int, vocab: int) -> float:
    """Size of one fp32 [tokens, vocab] logits buffer in MiB."""
    return tokens * vocab * FP32_BYTES / MIB


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line (Linux only)")


def _run(implementation: str, mode: str, hidden, weight, labels, chunk_size: int):
    import torch

    from grpo_mega.model import vocab_parallel_logprobs_and_entropy

    def compute():
        if implementation == "full":
            return full_logprobs_and_entropy(hidden, weight, labels)
        return vocab_parallel_logprobs_and_entropy(hidden, weight, labels, vocab_size=weight.shape[0],
                                                   chunk_size=chunk_size)

    if mode == "logprobs":
        with torch.no_grad():
            return compute()
    logprobs, entropy = compute()
    advantages = torch.linspace(-1.0, 1.0, labels.shape[0])
    (-(advantages * logprobs).mean()).backward()
    return logprobs.detach(), entropy.detach()


def _measure(implementation: str, mode: str, vocab: int, tokens: int, hidden_size: int, chunk_size: int) -> dict:
    """One fresh process: the peak resident growth (MiB) and seconds of one call, and checksums of its outputs."""
    import torch

    from grpo_mega.parallel import init_distributed

    if ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    init_distributed(1, 1, seed=0, device="cpu")  # the chunked path reduces over megatron's TP group (of 1)

    def inputs(count: int):
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(count, hidden_size, generator=generator).requires_grad_(mode == "train")
        weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
        weight.requires_grad_(mode == "train")
        return hidden, weight, torch.randint(0, vocab, (count,), generator=generator)

    _run(implementation, mode, *inputs(min(tokens, 256)), chunk_size)  # warm-up: first-call allocations
    hidden, weight, labels = inputs(tokens)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current resident set
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    logprobs, entropy = _run(implementation, mode, hidden, weight, labels, chunk_size)
    seconds = time.perf_counter() - start
    return {"peak_mib": (_status_kib("VmHWM") - before) / 1024, "seconds": seconds,
            "logprob_sum": float(logprobs.double().sum()), "entropy_sum": float(entropy.double().sum())}


def savings(rows: list[dict]) -> list[dict]:
    """One line per (vocab, mode) measured by both implementations: their peaks, seconds, the MiB the chunked path
    saves, the ratio full / chunked, and whether their outputs agree (checksums within 1e-5 relative)."""
    by_key = {(r["vocab"], r["mode"], r["implementation"]): r for r in rows if "peak_mib" in r}
    lines = []
    for vocab in dict.fromkeys(r["vocab"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            full, chunked = by_key.get((vocab, mode, "full")), by_key.get((vocab, mode, "chunked"))
            if chunked is None:
                continue
            line = {"vocab": vocab, "mode": mode, "chunked_mib": chunked["peak_mib"],
                    "chunked_seconds": chunked["seconds"], "logits_mib": chunked["logits_mib"]}
            if full is not None:
                agree = all(abs(full[k] - chunked[k]) <= 1e-5 * max(1.0, abs(full[k]))
                            for k in ("logprob_sum", "entropy_sum"))
                line.update(full_mib=full["peak_mib"], full_seconds=full["seconds"],
                            saved_mib=full["peak_mib"] - chunked["peak_mib"],
                            ratio=full["peak_mib"] / max(chunked["peak_mib"], 1e-9), outputs_agree=agree)
            lines.append(line)
    return lines


COLUMNS = [("vocab", "vocab", "d"), ("mode", "mode", ""), ("[N,V] MiB", "logits_mib", ".0f"),
           ("full MiB", "full_mib", ".0f"), ("chunked MiB", "chunked_mib", ".0f"), ("saved MiB", "saved_mib", ".0f"),
           ("full/chunked", "ratio", ".1f"), ("full s", "full_seconds", ".2f"), ("chunked s", "chunked_seconds", ".2f"),
           ("agree", "outputs_agree", "")]


def main() -> None:
    from grpo_mega.config import ModelConfig
    from grpo_mega.run.launcher import spawn_local_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (the fixed batch)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (the 3m workload's)")
    parser.add_argument("--chunk-size", type=int, default=ModelConfig.logprob_chunk_size,
                        help="the chunked path's tokens per chunk (default: model.logprob_chunk_size's default)")
    parser.add_argument("--memory-fraction", type=float, default=0.7,
                        help="skip a naive point estimated to need more than this share of MemAvailable")
    parser.add_argument("--quick", action="store_true", help="1024 tokens")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/logprob_memory.json")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 1024
    if not Path("/proc/self/clear_refs").exists():
        parser.error("needs Linux /proc/self/clear_refs to reset the peak resident set")
    started, load_before = time.time(), load_average()
    rows = []
    for vocab in args.vocabs:
        for mode in MODES:
            for implementation in IMPLEMENTATIONS:
                row = {"vocab": vocab, "mode": mode, "implementation": implementation,
                       "logits_mib": logits_mib(args.tokens, vocab)}
                need, available = NAIVE_BUFFERS * row["logits_mib"], _available_mib()
                if implementation == "full" and need > args.memory_fraction * available:
                    row["skipped"] = f"needs about {need:.0f} MiB, {available:.0f} MiB available"
                else:
                    (result,) = spawn_local_ranks(_measure, 1, (implementation, mode, vocab, args.tokens, args.hidden,
                                                                args.chunk_size), threads=2, timeout=1800)
                    row.update(result)
                rows.append(row)
                print(f"vocab {vocab} {mode} {implementation}: "
                      + (row.get("skipped") or f"{row['peak_mib']:.0f} MiB, {row['seconds']:.2f} s"), flush=True)
    table_rows = savings(rows)
    record = build_record({
        "batch": {"tokens": args.tokens, "hidden": args.hidden, "chunk_size": args.chunk_size, "dtype": "float32",
                  "threads": 2},
        "results": rows, "savings": table_rows,
    }, started=started, load_before=load_before)
    print(text_table(COLUMNS, table_rows))
    write_record(record, args.out)


if __name__ == "__main__":
    main()
