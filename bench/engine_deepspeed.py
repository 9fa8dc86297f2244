"""DeepSpeed ZeRO engine vs Megatron engine: GRPO update step time and peak memory on the same model.

Every configuration runs on 2 gloo processes (1 thread each) from the same weights: the Megatron engine at TP=1 x
DP=2 and TP=2, and the DeepSpeed engine at ZeRO stage 1, 2, 3 and 2 with optimizer offload. One step is what the
trainer's update stage does: the GRPO loss (token-mean, clipped ratio) over a batch shaped like the quickstart's
(``--rows`` rows of ``--prompt`` + up to ``--response`` tokens, random lengths), ``--warmup`` untimed then
``--steps`` timed optimizer steps, plus one weight export (what weight sync reads). Peak memory is the peak RSS
(ru_maxrss) of the busiest rank, and its growth from before the engine was built (the engine's own share: model,
gradients, optimizer state, activations).

    python bench/engine_deepspeed.py --size quickstart --out bench/results/engine_deepspeed.json

Prints a table and, last, the path of the JSON written.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SIZES = {
    # the quickstart policy (grpo_mega.quickstart.pipeline.POLICY_SHAPE) with a 512-token vocabulary: ~0.9M parameters
    "quickstart": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    # ~25M parameters: hidden 512, 8 layers, GQA 8/4, vocab 8192
    "25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=True),
}
# name: (engine, tensor parallel, zero stage, offload optimizer)
CONFIGS = {
    "megatron dp2": ("megatron", 1, None, False),
    "megatron tp2": ("megatron", 2, None, False),
    "deepspeed zero1": ("deepspeed", 1, 1, False),
    "deepspeed zero2": ("deepspeed", 1, 2, False),
    "deepspeed zero3": ("deepspeed", 1, 3, False),
    "deepspeed zero2+offload": ("deepspeed", 1, 2, True),
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batch(vocab: int, rows: int, prompt: int, response: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    length = prompt + response
    lengths = prompt + torch.randint(response // 4, response + 1, (rows,), generator=generator)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    attention_mask = (torch.arange(length) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :prompt] = 0
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, length).contiguous()
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, advantages=advantages)


def _worker(config: str, size: str, weights_dir: str, rows: int, prompt: int, response: int, budget: int,
            warmup: int, steps: int):
    import torch
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import DeepSpeedConfig, OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn
    from grpo_mega.parallel import init_distributed

    kind, tp, stage, offload = CONFIGS[config]
    torch.set_num_threads(1)
    init_distributed(tp, 1, seed=0, device="cpu")
    hf_config = AutoConfig.from_pretrained(weights_dir)
    before = _rss_mib()
    settings = DeepSpeedConfig(zero_stage=stage, offload_optimizer=offload) if kind == "deepspeed" else None
    engine = build_policy_engine(hf_config, optim=OptimConfig(lr=1e-5), total_steps=warmup + steps,
                                 max_tokens_per_micro_batch=budget, engine_kind=kind, deepspeed=settings)
    engine.load_hf_weights(HFWeights(weights_dir))
    batch = _batch(hf_config.vocab_size, rows, prompt, response)
    loss_fn = grpo_loss_fn(GRPOLossSettings(loss_agg_mode="token-mean", on_policy=True))
    losses, times = [], []
    for index in range(warmup + steps):
        start = time.perf_counter()
        metrics = engine.train_step(batch, loss_fn)
        engine.lr_schedule_step()
        if index >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    start = time.perf_counter()
    exported = sum(t.numel() for _, t in engine.export_hf_weights())
    export_seconds = time.perf_counter() - start
    return {"step_s": sum(times) / len(times), "min_step_s": min(times), "export_s": export_seconds,
            "peak_rss_mib": _rss_mib(), "engine_rss_mib": _rss_mib() - before, "first_loss": losses[0],
            "parameters": exported}


def _save_weights(size: str, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=256, **SIZES[size])
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="quickstart")
    parser.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--rows", type=int, default=256, help="rows per step (quickstart: 32 prompts x 8)")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--budget", type=int, default=4096, help="parallel.max_tokens_per_micro_batch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine_deepspeed.json"))
    args = parser.parse_args(argv)

    import tempfile

    from dist_utils import run_distributed

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        weights_dir = Path(scratch) / "weights"
        _save_weights(args.size, weights_dir)
        for config in args.configs:
            per_rank = run_distributed(_worker, 2, config, args.size, str(weights_dir), args.rows, args.prompt,
                                       args.response, args.budget, args.warmup, args.steps, timeout=1200)
            results[config] = {
                "step_s": max(r["step_s"] for r in per_rank),
                "min_step_s": max(r["min_step_s"] for r in per_rank),
                "export_s": max(r["export_s"] for r in per_rank),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank),
                "engine_rss_mib": max(r["engine_rss_mib"] for r in per_rank),
                "first_loss": per_rank[0]["first_loss"],
                "parameters": per_rank[0]["parameters"],
            }
            print(f"{config}: {results[config]['step_s']:.3f} s/step", flush=True)

    print()
    print(f"model {args.size} ({next(iter(results.values()))['parameters'] / 1e6:.2f}M parameters), "
          f"{args.rows} rows x <= {args.prompt + args.response} tokens, 2 processes x 1 thread, fp32 CPU")
    print(f"{'engine':26}{'step s':>9}{'min s':>9}{'export s':>10}{'peak RSS MiB':>14}{'engine MiB':>12}{'loss':>10}")
    for config, r in results.items():
        print(f"{config:26}{r['step_s']:>9.3f}{r['min_step_s']:>9.3f}{r['export_s']:>10.3f}{r['peak_rss_mib']:>14.0f}"
              f"{r['engine_rss_mib']:>12.0f}{r['first_loss']:>10.5f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"size": args.size, "rows": args.rows, "prompt": args.prompt,
                                    "response": args.response, "budget": args.budget, "steps": args.steps,
                                    "results": results}, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
