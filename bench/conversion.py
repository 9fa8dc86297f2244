"""Time and peak memory of HF <-> megatron conversion for a Qwen2.5-0.5B-shaped random model.

Builds a random Qwen2 model of the chosen shape with transformers, saves it, then runs the three
tools as a user would (each one a subprocess that starts its own tp*pp ranks) and checks that the
round trip is bit-identical. For every step it reports wall time, the peak resident memory (RSS) of
the largest single process and the peak proportional set size (PSS: shared pages split between the
processes sharing them, so forked writers are not counted twice) of all the step's processes together,
sampled every 0.1 s with psutil (short spikes may be missed). RSS includes file pages of memory-mapped
safetensors, which the kernel can drop under pressure. CPU seconds / wall seconds shows how much of the machine
the step had (the CI machines are shared).

    OMP_NUM_THREADS=1 python bench/conversion.py --work /tmp/conv --tp 1 --pp 1 --out runs/conv.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
# Qwen2.5-0.5B's shape (tied embeddings, GQA 14/2, vocabulary 151936): 494M parameters.
PRESETS = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=128),
}


def parse_args() -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="empty scratch folder (needs ~3x model size)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    parser.add_argument("--tp", type=int, default=1, help="ranks for the conversion tools")
    parser.add_argument("--pp", type=int, default=1, help="ranks for the conversion tools")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return parser.parse_args()


def measure(command: list[str]) -> dict:
    """Run a command; return wall s, CPU s, peak RSS of the largest process and peak PSS of the tree (GiB)."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)
    root = psutil.Process(process.pid)
    peak_single = peak_tree = 0
    cpu_seen: dict[int, float] = {}
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        total = 0
        for member in tree:
            try:
                memory = member.memory_full_info()
                times = member.cpu_times()
            except psutil.NoSuchProcess:
                continue
            cpu_seen[member.pid] = times.user + times.system
            peak_single, total = max(peak_single, memory.rss), total + memory.pss
        peak_tree = max(peak_tree, total)
        time.sleep(0.1)
    output = process.communicate()[0]
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    gib = 1024**3
    return {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(sum(cpu_seen.values()), 1),
            "peak_rss_largest_gib": round(peak_single / gib, 2), "peak_pss_all_gib": round(peak_tree / gib, 2),
            "output": [line for line in output.splitlines() if line.strip()][-4:]}


def build_hf_model(folder: Path, preset: str) -> dict:
    """Save a random Qwen2 model of the preset's shape; return its parameter count and bytes."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**PRESETS[preset])).float()
    model.save_pretrained(folder)
    count = sum(p.numel() for p in model.parameters())
    return {"parameters": count, "fp32_gib": round(count * 4 / 1024**3, 2)}


def round_trip_is_identical(original: Path, exported: Path) -> bool:
    """torch.equal on every tensor of two HF folders, read one tensor at a time."""
    from grpo_mega.checkpoint import HFWeights

    left, right = HFWeights(original), HFWeights(exported)
    return set(left) == set(right) and all(torch.equal(left[name], right[name]) for name in left)


def main() -> None:
    """Build, convert both ways, compare, and print the figures."""
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if any(args.work.iterdir()):
        raise SystemExit(f"--work {args.work} is not empty")
    hf, ckpt, back = args.work / "hf", args.work / "mcore", args.work / "hf_back"
    ranks = ["--tp", str(args.tp), "--pp", str(args.pp)]
    tool = lambda name: [sys.executable, str(REPO / "tools" / name)]
    started = time.perf_counter()
    figures = {"preset": args.preset, "tp": args.tp, "pp": args.pp, "cpus": os.cpu_count(),
               **build_hf_model(hf, args.preset)}
    figures["build_hf_s"] = round(time.perf_counter() - started, 1)
    figures["hf_to_mcore"] = measure([*tool("convert_hf_to_mcore.py"), "--hf", str(hf), "--out", str(ckpt), *ranks])
    figures["mcore_to_hf"] = measure([*tool("convert_mcore_to_hf.py"), "--ckpt", str(ckpt), "--out", str(back), *ranks])
    figures["compare"] = measure([*tool("compare_with_hf.py"), "--hf", str(hf), "--ckpt", str(ckpt), *ranks,
                                  "--seq-len", "64", "--atol", "1e-3"])
    figures["round_trip_bit_identical"] = round_trip_is_identical(hf, back)
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
