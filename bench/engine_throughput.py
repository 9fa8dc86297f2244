"""Training throughput and peak memory of the Megatron engine on CPU: TP vs PP vs DP on 2 processes.

For each model size and layout it runs ``--warmup`` + ``--steps`` optimizer steps of an SFT-style loss on random
tokens (batch ``--batch`` x ``--seq`` tokens, every token trained) and reports training tokens/s (timed steps
only) and the peak RSS of the busiest rank (ru_maxrss). Layouts: ``1x2t`` one process with 2 threads (TP=1), and
on 2 processes with 1 thread each: ``dp2`` (TP=1, DP=2), ``tp2`` and ``pp2``.

    python bench/engine_throughput.py --sizes 3m 25m --out bench/results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SIZES = {
    # ~3.2M parameters (FINDINGS.md's model): hidden 256, 4 layers, GQA 4/2, vocab 512
    "3m": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512),
    # ~25M parameters: hidden 512, 8 layers, GQA 8/4, vocab 8192
    "25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8192),
}
LAYOUTS = {"1x2t": (1, 1, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 2), "pp2": (1, 2, 2)}


def _worker(size: str, tp: int, pp: int, batch: int, seq: int, warmup: int, steps: int, threads: int):
    import torch
    from transformers import Qwen2Config

    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import init_distributed
    from grpo_mega.sft import sft_loss

    torch.set_num_threads(threads)
    init_distributed(tp, pp, seed=0)
    hf = Qwen2Config(max_position_embeddings=seq, tie_word_embeddings=True, **SIZES[size])
    engine = build_policy_engine(hf, optim=OptimConfig(lr=1e-4), total_steps=warmup + steps,
                                 max_tokens_per_micro_batch=batch * seq // 4)
    params = sum(p.numel() for p in engine.stage.parameters())
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, hf.vocab_size, (batch, seq), generator=generator)
    ones = torch.ones(batch, seq, dtype=torch.long)
    data = dict(input_ids=input_ids, attention_mask=ones, loss_mask=ones)
    for _ in range(warmup):
        engine.train_step(data, sft_loss)
        engine.lr_schedule_step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_step(data, sft_loss)
        engine.lr_schedule_step()
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, params_on_rank=params,
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from dist_utils import run_distributed

    results = []
    for size in args.sizes:
        for layout in args.layouts:
            tp, pp, world = LAYOUTS[layout]
            threads = 2 if world == 1 else 1
            per_rank = run_distributed(_worker, world, size, tp, pp, args.batch, args.seq, args.warmup, args.steps,
                                       threads, timeout=1800)
            seconds = max(r["seconds"] for r in per_rank)
            row = dict(size=size, layout=layout, tokens_per_s=round(args.batch * args.seq * args.steps / seconds, 1),
                       s_per_step=round(seconds / args.steps, 3),
                       peak_rss_mib=round(max(r["peak_rss_mib"] for r in per_rank), 1),
                       params_per_rank=[r["params_on_rank"] for r in per_rank])
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)}, results=results), indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
