"""Where the GRPO update's time goes: one process (TP=1), the workload model, a GRPO batch like the benchmark's
(``--rows`` rows of a short prompt + ``--response`` response tokens), ``--steps`` timed ``train_step`` calls, and
torch.profiler's top operators of the last one.

    python bench/profile_update.py --size 3m --rows 512 --threads 2 [--micro-tokens 4096] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="3m")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import torch
    from transformers import Qwen2Config

    from grpo_mega.config import AlgorithmConfig, OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import init_distributed
    from grpo_mega.stages.update import grpo_loss_fn, loss_settings
    from workload import SIZES, count_parameters, train_flops

    torch.set_num_threads(args.threads)
    init_distributed(1, 1, seed=0)
    hf = Qwen2Config(vocab_size=320, max_position_embeddings=256, tie_word_embeddings=True, **SIZES[args.size])
    engine = build_policy_engine(hf, optim=OptimConfig(lr=1e-5), total_steps=10,
                                 max_tokens_per_micro_batch=args.micro_tokens)
    length = args.prompt + args.response
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (args.rows, length), generator=g)
    loss_mask = torch.zeros(args.rows, length, dtype=torch.long)
    loss_mask[:, args.prompt:] = 1
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask,
                 advantages=torch.randn(args.rows, length, generator=g) * loss_mask,
                 rollout_logprobs=torch.full((args.rows, length), -5.0) * loss_mask,
                 response_lengths=torch.full((args.rows,), args.response))
    loss_fn = grpo_loss_fn(loss_settings(AlgorithmConfig(), on_policy=True))
    engine.train_step(batch, loss_fn)  # warm-up
    _, matmul = count_parameters(hf)
    flops = train_flops(matmul, SIZES[args.size], args.rows * length, [length] * args.rows)
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.train_step(batch, loss_fn)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        # CPU seconds of this process: with --threads 1 a figure that other load on the machine barely moves
        print(f"train_step {seconds:.2f} s, {flops / seconds / 1e9:.1f} GFLOP/s; {cpu_seconds:.2f} CPU s")
    if args.profile:
        with torch.profiler.profile() as prof:
            engine.train_step(batch, loss_fn)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
