"""Rollout engines on CPU: hf (transformers generate) vs vllm (vLLM's CPU backend) on the ~3M and ~25M Qwen2-shaped
policies of bench/engine_throughput.py (random weights, synced into the engine as the trainer does).

Workload per call (quickstart-like): ``--prompts`` prompts of ``--prompt-len`` random tokens, ``--group``
completions each, at most ``--new-tokens`` tokens, temperature 1. Each engine runs in a fresh process and reports:
start-up (engine construction + first weight sync), generated tokens/s (median of ``--repeats`` timed calls after
one warm-up call), time to first token (median wall time of the same request with max_new_tokens=1: prefill and
one sampling step for the whole batch) and the process's peak RSS (ru_maxrss). Prints a table, writes JSON and
prints its path last.

    python bench/rollout_engines.py --sizes 3m 25m 135m --out bench/results/rollout_engines.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import SIZES as TRAINING_SIZES  # noqa: E402  (the shared ~3M / ~25M model shapes)
from report import machine  # noqa: E402

# and a ~135M one in SmolLM2-135M's shape (hidden 576, 30 layers, GQA 9/3, vocab 49,152): where the CPU crossover
# of the engines is looked for (grpo_mega/rollout/engine_choice.py takes its threshold from these rows)
SIZES = {**TRAINING_SIZES, "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)}

ENGINES = ("hf", "vllm")


def write_model_folder(folder: Path, size: str, max_len: int) -> None:
    """config.json and a word-level tokenizer covering the vocabulary (``<unk> <s> </s> <pad> t4 t5 ...``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(max_position_embeddings=max_len, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3, **SIZES[size])
    config.save_pretrained(folder)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(specials + [f"t{i}" for i in range(len(specials), config.vocab_size)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(folder)


def run_engine(args: argparse.Namespace) -> dict:
    """One engine on one size, in this process (called in a fresh subprocess by main)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.rollout import SamplingConfig, build_rollout_engine, sync_weights

    torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).eval()  # the trainer's weights
    parameters = sum(p.numel() for p in policy.parameters())
    start = time.perf_counter()
    if args.engine == "hf":
        engine = build_rollout_engine("hf", model_path=folder, tokenizer=folder, dtype="float32",
                                      generation_batch_size=args.prompts)
    else:
        engine = build_rollout_engine("vllm", model_path=folder, tokenizer=folder, dtype="float32", enforce_eager=True,
                                      max_model_len=args.prompt_len + args.new_tokens)
    sync_weights(policy.state_dict().items(), engine, bucket_bytes=64 * 2**20)
    startup = time.perf_counter() - start
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, policy.config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()

    def timed(max_new_tokens: int, seed: int) -> tuple[float, int]:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, n=args.group, seed=seed)
        begin = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        return time.perf_counter() - begin, sum(len(c.response_ids) for c in completions)

    timed(args.new_tokens, 0)  # warm-up
    runs = [timed(args.new_tokens, seed) for seed in range(1, args.repeats + 1)]
    first_token = statistics.median(timed(1, seed)[0] for seed in range(1, args.repeats + 1))
    seconds = statistics.median(s for s, _ in runs)
    tokens = statistics.median(t for _, t in runs)
    if hasattr(engine, "close"):
        engine.close()
    return {
        "size": args.size, "engine": args.engine, "parameters": parameters, "startup_s": startup,
        "tokens_per_s": tokens / seconds, "generate_s": seconds, "generated_tokens": tokens,
        "time_to_first_token_s": first_token, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["3m", "25m", "135m"], choices=sorted(SIZES))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each engine's process")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "rollout_engines.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_engine(args)), flush=True)
        return

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes:
            folder = Path(scratch) / size
            write_model_folder(folder, size, args.prompt_len + args.new_tokens)
            for engine in args.engines:
                command = [sys.executable, __file__, "--worker", "--engine", engine, "--size", size,
                           "--folder", str(folder), *_shared_flags(args)]
                done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
                results = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not results:
                    raise SystemExit(f"{engine} on {size} failed:\n{done.stderr[-3000:]}")
                rows.append(json.loads(results[-1]))

    header = f"{'size':>5} {'engine':>6} {'params':>7} {'start s':>8} {'tok/s':>8} {'gen s':>7} {'TTFT s':>7} {'peak RSS MiB':>13}"
    print(header)
    for r in rows:
        print(f"{r['size']:>5} {r['engine']:>6} {r['parameters'] / 1e6:>6.1f}M {r['startup_s']:>8.1f} "
              f"{r['tokens_per_s']:>8.0f} {r['generate_s']:>7.2f} {r['time_to_first_token_s']:>7.3f} "
              f"{r['peak_rss_mib']:>13.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workload = {k: getattr(args, k) for k in ("prompts", "group", "prompt_len", "new_tokens", "repeats", "threads")}
    out.write_text(json.dumps({"workload": workload, "load_average_at_end": os.getloadavg(), "cpu_count": os.cpu_count(),
                               "cpu": machine()["cpu"],
                               "rows": rows}, indent=2) + "\n")
    print(out)


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--prompts", str(args.prompts), "--group", str(args.group), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]


if __name__ == "__main__":
    main()
