"""GRPO step benchmark: grpo-mega against TRL's GRPOTrainer and against the machine's matmul peak, back to back.

For each model size (``bench/workload.py``: ~3M and ~25M Qwen2-shaped, seeded random weights shared by both
trainers) it runs, in this order: the fp32 matmul peak at 2 threads, ``--steps`` GRPO steps of ours
(``bench/ours_grpo.py``: 2 gloo processes x 1 thread, layout ``--layout``), ``--trl-steps`` steps of TRL
(``bench/trl_grpo.py``: 1 process x 2 threads), and the peak again. The first step of each is warm-up and not
counted. Workload: ``--prompts`` prompts x G=``--group`` completions of up to ``--max-new`` tokens, temperature 1,
one optimizer step per batch, no KL.

Reported per trainer: seconds per step and per phase, generated and trained tokens/s, peak RSS per process, the
load average around the run; for ours also the training phase's FLOP/s (6 x matmul parameters x trained tokens
+ attention) as a fraction of the measured peak, and weight-sync seconds and bytes. ``speedup_vs_trl`` is TRL's
step seconds over ours. The table goes to stdout, the JSON record to ``--out`` (its path printed last).

    python bench/grpo_vs_trl.py                    # 3m and 25m, the full workload (about 25 min on 2 cores)
    python bench/grpo_vs_trl.py --quick            # 3m only, 2 steps each (about 5 min)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from matmul_peak import matmul_peak  # noqa: E402
from ours_grpo import MICRO_TOKENS as OURS_MICRO_TOKENS  # noqa: E402
from report import load_average, machine, run_script  # noqa: E402
from workload import SIZES, build_workload, digit_reward, train_flops  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def run_ours(work, args, out: Path) -> dict:
    tensor, pipeline = LAYOUTS[args.layout]
    load_before = load_average()
    run_script("ours_grpo.py", "--model", str(work.model_dir), "--prompts", str(work.train_file),
            "--run-dir", str(out.parent / f"ours_{work.size}" / "run"), "--num-prompts", str(args.prompts),
            "--group", str(args.group), "--max-new", str(args.max_new), "--steps", str(args.steps), "--nproc", "2",
            "--tensor", str(tensor), "--pipeline", str(pipeline), "--out", str(out))
    raw = json.loads(out.read_text())
    rows = raw["steps"][1:]  # the first step is warm-up

    def avg(key):
        return mean(row.get(key, 0.0) for row in rows)

    tokens, response_tokens, update = avg("perf/num_tokens"), avg("perf/num_response_tokens"), avg("timing_s/update")
    config = SIZES[work.size]
    per_row = tokens / (args.prompts * args.group)
    # what went through the layers: with shared prompts fewer tokens than the rows hold (attention stays per row)
    layer_tokens = avg("perf/layer_tokens") or tokens
    flops = train_flops(work.matmul_parameters, config, int(layer_tokens), [per_row] * (args.prompts * args.group))
    return {
        "step_seconds": avg("timing_s/step"),
        "phases": {"gen+reward": avg("timing_s/gen"), "logprobs": avg("timing_s/old_logprob"),
                   "update": update, "sync": avg("timing_s/sync")},
        "generated_tokens_per_s": response_tokens / avg("timing_s/gen"),
        "trained_tokens_per_s": tokens / update,
        "tokens_per_step": tokens, "response_tokens_per_step": response_tokens, "layer_tokens_per_step": layer_tokens,
        "train_gflops": flops / update / 1e9,
        "sync_bytes": avg("perf/sync_bytes"),  # per process: what its trainer copies into its rollout engine
        "peak_rss_mb": raw["peak_rss_mb"], "processes": raw["processes"], "layout": args.layout,
        "steps_measured": len(rows), "step_seconds_each": [row["timing_s/step"] for row in rows],
        "load_average": [load_before, load_average()], "command": raw["command"],
    }


def run_trl(work, args, out: Path) -> dict:
    load_before = load_average()
    run_script("trl_grpo.py", "--model", str(work.model_dir), "--prompts", str(work.train_file),
            "--num-prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
            "--steps", str(args.trl_steps), "--micro-batch", str(args.trl_micro_batch), "--threads", "2",
            "--out", str(out))
    raw = json.loads(out.read_text())
    rows = raw["steps"][1:]
    tokens, response_tokens = mean(r["tokens"] for r in rows), mean(r["response_tokens"] for r in rows)
    gen, update = mean(r["gen"] for r in rows), mean(r["update"] for r in rows)
    return {
        "step_seconds": mean(r["step"] for r in rows), "phases": {"gen+reward": gen, "update": update},
        "generated_tokens_per_s": response_tokens / gen, "trained_tokens_per_s": tokens / update,
        "tokens_per_step": tokens, "response_tokens_per_step": response_tokens, "peak_rss_mb": raw["peak_rss_mb"],
        "processes": 1, "trl_version": raw["trl_version"], "steps_measured": len(rows),
        "step_seconds_each": [r["step"] for r in rows],
        "load_average": [load_before, load_average()],
    }


def reward_seconds(count: int, length: int) -> float:
    """The reward function alone over ``count`` completions of ``length`` characters (it runs inside gen)."""
    texts = [("12 ab " * length)[:length] for _ in range(count)]
    start = time.perf_counter()
    for text in texts:
        digit_reward("", text, "")
    return time.perf_counter() - start


def bench_size(size: str, args, folder: Path) -> dict:
    work = build_workload(folder / "workload", size)
    peak_before = matmul_peak(2)
    ours = run_ours(work, args, folder / f"ours_{size}.json")
    trl = run_trl(work, args, folder / f"trl_{size}.json")
    peak_after = matmul_peak(2)
    peak = max(peak_before["gflops"], peak_after["gflops"])
    return {
        "size": size, "parameters": work.parameters, "matmul_parameters": work.matmul_parameters,
        "step_seconds": ours["step_seconds"], "trl_step_seconds": trl["step_seconds"],
        "speedup_vs_trl": trl["step_seconds"] / ours["step_seconds"],
        "train_flops_fraction_of_peak": ours["train_gflops"] / peak,
        "matmul_peak_gflops": peak, "matmul_peak_runs": [peak_before, peak_after],
        "reward_seconds_standalone": reward_seconds(args.prompts * args.group, 4 * args.max_new),
        "ours": ours, "trl": trl,
    }


def table(results: list[dict]) -> str:
    lines = [f"{'model':>5} {'trainer':>7} {'step s':>7} {'gen s':>6} {'update s':>8} {'sync s':>6} "
             f"{'gen tok/s':>9} {'train tok/s':>11} {'RSS MiB':>8} {'load':>11}  notes"]
    for r in results:
        for name in ("ours", "trl"):
            x = r[name]
            note = (f"{r['ours']['train_gflops']:.1f} GFLOP/s = {100 * r['train_flops_fraction_of_peak']:.0f}% of "
                    f"{r['matmul_peak_gflops']:.0f} peak; sync {x['sync_bytes'] / 2**20:.1f} MiB"
                    if name == "ours" else f"speedup {r['speedup_vs_trl']:.2f}x (trl {x['trl_version']})")
            load = "-".join(f"{v:.1f}" for v in x["load_average"])
            lines.append(
                f"{r['size']:>5} {name:>7} {x['step_seconds']:7.2f} {x['phases']['gen+reward']:6.2f} "
                f"{x['phases']['update']:8.2f} {x['phases'].get('sync', 0.0):6.2f} {x['generated_tokens_per_s']:9.0f} "
                f"{x['trained_tokens_per_s']:11.0f} {x['peak_rss_mb']:8.0f} {load:>11}  {note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["3m", "25m"], choices=sorted(SIZES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="our steps, the first one warm-up")
    # 3: TRL's generation time varied 36-60 s between single steps of the same 25M workload on an idle machine
    parser.add_argument("--trl-steps", type=int, default=3, help="TRL's steps, the first one warm-up")
    parser.add_argument("--trl-micro-batch", type=int, default=64, help="completions per TRL forward/backward")
    parser.add_argument("--layout", default="dp2", choices=sorted(LAYOUTS), help="our 2-process layout")
    parser.add_argument("--quick", action="store_true", help="3m only, 2 steps each")
    parser.add_argument("--work", type=Path, default=Path("/tmp/grpo_mega_bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/grpo_vs_trl.json")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.trl_steps = ["3m"], 2, 2
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results = [bench_size(size, args, args.work) for size in args.sizes]
    record = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_seconds": round(time.time() - started, 1),
        "workload": {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new,
                     "temperature": 1.0, "updates_per_batch": 1, "kl": 0.0, "dtype": "float32",
                     "micro_batch": {"ours_tokens": OURS_MICRO_TOKENS, "trl_completions": args.trl_micro_batch}},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        # headline figures: the largest model measured
        **{k: results[-1][k] for k in ("step_seconds", "trl_step_seconds", "speedup_vs_trl",
                                       "train_flops_fraction_of_peak")},
        "results": results,
    }
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
