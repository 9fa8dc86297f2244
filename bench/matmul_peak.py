"""The machine's fp32 matmul peak as torch sees it: the best GFLOP/s of square ``torch.mm`` over a few sizes.

Each size runs for about ``seconds`` after a warm-up and reports its best repetition; the peak is the best over
sizes. ``--bandwidth`` also measures the memory bandwidth (the best bytes/s of copying a 256 MiB fp32 tensor into
another: read + write), the CPU profile's second figure for the step-time model (``grpo_mega.plan.devices``). Measured with the thread count given (the benchmark measures it with the threads its training phase uses,
in the same run, so the fraction of peak is taken under the same load).

    python bench/matmul_peak.py --threads 2
    python bench/matmul_peak.py --threads 1 2 --bandwidth
"""

from __future__ import annotations

import argparse
import json
import os
import time

SIZES = (512, 1024, 2048)


def matmul_gflops(n: int, seconds: float = 1.0) -> float:
    """Best GFLOP/s of an [n, n] @ [n, n] fp32 product over repetitions filling about ``seconds``."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * n**3 / elapsed / 1e9)
        if time.perf_counter() > deadline:
            return best


def memory_bandwidth(threads: int, seconds: float = 1.0, mib: int = 256) -> float:
    """Best bytes/s of ``dst.copy_(src)`` over two ``mib`` MiB fp32 tensors (bytes read + written) at ``threads``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randn(mib * 2**18)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up (pages touched)
        best, deadline = 0.0, time.perf_counter() + seconds
        while True:
            start = time.perf_counter()
            dst.copy_(src)
            best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - start))
            if time.perf_counter() > deadline:
                return best
    finally:
        torch.set_num_threads(previous)


def matmul_peak(threads: int, seconds: float = 1.0) -> dict:
    """{"threads", "gflops" (the best), "by_size": {n: GFLOP/s}, "load_average"} at ``threads`` threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        by_size = {n: round(matmul_gflops(n, seconds), 1) for n in SIZES}
    finally:
        torch.set_num_threads(previous)
    return {"threads": threads, "gflops": max(by_size.values()), "by_size": by_size,
            "load_average": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--bandwidth", action="store_true", help="also the memory bandwidth (GB/s) at each thread count")
    args = parser.parse_args()
    for threads in args.threads:
        result = matmul_peak(threads, args.seconds)
        if args.bandwidth:
            result["memory_gb_s"] = round(memory_bandwidth(threads, args.seconds) / 1e9, 2)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
