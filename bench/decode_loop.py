"""The hf engine's decode loop (``grpo_mega/rollout/hf_decode.py``) against transformers' ``generate`` on the same
model, prompts and sampling (issue 40), and against the loop of an earlier commit (``--before REV``, default
``main``; issue 77: the loop without per-step host reads and with the sort-free sampler): seconds per call,
generated tokens/s, and the share of decode row-steps the loop skipped because their rows had ended.

Model: the ~3M / ~25M Qwen2 shapes of bench/engine_throughput.py, or ``quickstart`` (the CPU quickstart's policy
shape, configs/models/quickstart-policy), seeded random weights. Random weights rarely
emit EOS, so every row runs to the limit; a trained policy's completions end at very different lengths. Each size
therefore runs twice: as is, and with an EOS bias (``log(vocab / L)`` added to EOS's logit, L = ``--mean-length``:
each step then ends a row with probability ~1/L). ``generate`` is called as the engine called it before: one
prefill of each prompt but its last token, its KV cache (``kv_cache.preallocated_cache``) repeated for the G
samples, sampling at T=1 with no top-k / top-p, EOS kept. Both sides run in this process, 2 intra-op threads,
alternating, median of ``--repeats``. The earlier loop is its file read from git (``git show REV:...``) and
called as that commit's engine called it (2D attention mask); the tokens differ (another sampler), not the workload.

    python bench/decode_loop.py                      # ~6 min on 2 cores; writes bench/results/decode_loop.json
    python bench/decode_loop.py --sizes quickstart --prompts 16 --prompt-len 24 --mean-length 32
                                                     # one quickstart rank's generation (16 prompts x 8, 64 tokens)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from report import load_average, machine  # noqa: E402
from rollout_engines import write_model_folder  # noqa: E402

EOS = 2  # write_model_folder's tokenizer: <unk> <s> </s> <pad>
REPO = BENCH.parent
SIDES = ("generate", "before", "decode_loop")


def _register_quickstart_size() -> None:
    """``quickstart``: the CPU quickstart's policy shape as a size of bench/rollout_engines.py."""
    import rollout_engines

    config = json.loads((REPO / "configs/models/quickstart-policy/config.json").read_text())
    rollout_engines.SIZES["quickstart"] = {key: config[key] for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size")}


def _earlier_decode(rev: str):
    """``decode`` of grpo_mega/rollout/hf_decode.py at ``rev`` (it imports torch and the standard library only)."""
    source = subprocess.run(["git", "show", f"{rev}:grpo_mega/rollout/hf_decode.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="decode-before-"))
    (folder / "hf_decode_before.py").write_text(source)
    spec = importlib.util.spec_from_file_location("hf_decode_before", folder / "hf_decode_before.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.decode


def _generate_call(model, input_ids, attention_mask, samples, max_new, cache_for):
    """transformers generate as the engine called it before the decode loop: tokens [rows, new]."""
    import torch
    from transformers import GenerationConfig

    cache = cache_for(input_ids, attention_mask, samples)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=[EOS], pad_token_id=3)
    with torch.inference_mode():
        sequences = model.generate(input_ids=input_ids.repeat_interleave(samples, 0),
                                   attention_mask=attention_mask.repeat_interleave(samples, 0),
                                   generation_config=config, past_key_values=cache)
    return sequences[:, input_ids.shape[1]:]


def run(size: str, mean_length: float, args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.rollout.hf_decode import decode
    from grpo_mega.rollout.hf_engine import HFRolloutEngine

    folder = Path(tempfile.mkdtemp(prefix="decode-loop-"))
    write_model_folder(folder, size, args.prompt_len + args.max_new + 8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).eval()
    bias = math.log(model.config.vocab_size / mean_length) if mean_length else 0.0
    if bias:
        model.lm_head.register_forward_hook(lambda module, inputs, output: output.index_add_(
            -1, torch.tensor([EOS]), torch.full((*output.shape[:-1], 1), bias)))
    engine = HFRolloutEngine(model, folder, generation_batch_size=args.prompts)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, model.config.vocab_size, (args.prompts, args.prompt_len), generator=generator)
    mask = torch.ones_like(prompts)

    def cache_for(input_ids, attention_mask, samples):
        return engine._shared_prompt_cache(input_ids, attention_mask, samples,
                                           capacity=input_ids.shape[1] + args.max_new)

    before = _earlier_decode(args.before)

    def ours(loop):
        cache = cache_for(prompts, None if loop is decode else mask, args.group)
        # the engine passes no mask for unpadded prompts now; the earlier loop took the 2D mask
        step_mask = None if loop is decode else mask.repeat_interleave(args.group, 0)
        with torch.inference_mode():
            out = loop(model, prompts.repeat_interleave(args.group, 0), step_mask, cache, max_new_tokens=args.max_new,
                       eos_token_ids=[EOS], pad_token_id=3)
        return out.tokens, out.row_steps

    def generated(tokens):
        ends = [(row == EOS).nonzero() for row in tokens]
        return sum(int(end[0]) + 1 if len(end) else tokens.shape[1] for end in ends)

    times = {name: [] for name in SIDES}
    counts = {name: [] for name in SIDES}
    skipped = []
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in SIDES:
            torch.manual_seed(100 + repeat)
            start = time.perf_counter()
            if name == "generate":
                tokens = _generate_call(model, prompts, mask, args.group, args.max_new, cache_for)
            else:
                tokens, row_steps = ours(decode if name == "decode_loop" else before)
            seconds = time.perf_counter() - start
            if repeat:
                times[name].append(seconds)
                counts[name].append(generated(tokens))
                if name == "decode_loop":
                    skipped.append(1 - row_steps / (tokens.shape[0] * args.max_new))
    row = {"size": size, "mean_length_bias": mean_length or None}
    for name in times:
        seconds = statistics.median(times[name])
        row[name] = {"seconds": seconds, "tokens": statistics.median(counts[name]),
                     "tokens_per_s": statistics.median(c / t for c, t in zip(counts[name], times[name]))}
    row["speedup"] = row["generate"]["seconds"] / row["decode_loop"]["seconds"]
    row["speedup_vs_before"] = row["before"]["seconds"] / row["decode_loop"]["seconds"]
    row["row_steps_skipped"] = statistics.median(skipped)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["3m", "25m"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--mean-length", type=float, default=24.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--before", default="main", help="git revision of the earlier decode loop (default main)")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "decode_loop.json")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    _register_quickstart_size()
    load_before = load_average()
    rows = [run(size, mean_length, args) for size in args.sizes for mean_length in (0.0, args.mean_length)]
    record = {"machine": machine(), "load_average": [load_before, load_average()], "workload": {
        k: getattr(args, k) for k in ("prompts", "group", "prompt_len", "max_new", "mean_length", "repeats",
                                      "threads", "before")}, "rows": rows, "cpu_count": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'size':>10} {'EOS bias':>9} {'generate s':>11} {'before s':>9} {'loop s':>7} {'vs gen':>7} "
          f"{'vs before':>9} {'gen tok':>8} {'before tok':>10} {'loop tok':>9} {'skipped':>8}")
    for r in rows:
        bias = f"L={r['mean_length_bias']:g}" if r["mean_length_bias"] else "none"
        print(f"{r['size']:>10} {bias:>9} {r['generate']['seconds']:>11.2f} {r['before']['seconds']:>9.2f} "
              f"{r['decode_loop']['seconds']:>7.2f} {r['speedup']:>6.2f}x {r['speedup_vs_before']:>8.2f}x "
              f"{r['generate']['tokens']:>8.0f} {r['before']['tokens']:>10.0f} {r['decode_loop']['tokens']:>9.0f} "
              f"{r['row_steps_skipped']:>7.0%}")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
