"""How our GRPO step scales: step time and its phases against layout, G, response length and model size, with
weight-sync seconds and bytes.

Every point is ``bench/ours_grpo.py`` in a fresh interpreter: ``grpo-mega train`` on 2 gloo processes x 1 thread,
hf rollouts, the workload of ``bench/grpo_vs_trl.py`` (``bench/workload.py``: seeded Qwen2-shaped weights,
``--prompts`` prompts, temperature 1, one update per batch, no KL, fp32), ``--steps`` steps of which the first
is warm-up and not counted. One axis varies at a time from the base point (3m, dp2 = TP=1 x DP=2, G=8, 64 new
tokens), which is measured once and shown on every axis:

- layout: dp2, tp2 (TP=2), pp2 (PP=2)
- group: G = 4, 8, 16
- response length: 32, 64, 128 new tokens
- model size: 3m, 25m

Sync bytes are what the trainer of one process copied into its rollout engine at the step's weight sync (the
trainer's ``perf/sync_bytes``, counted by ``grpo_mega.rollout.weight_sync``); every process has its own hf rollout
engine, so a step copies that many bytes per process. ``expected_sync_bytes`` is what the HF parameter count
predicts for the fp32 model, shown beside it. Prints the table and writes the JSON record (path printed last).

    python bench/grpo_scaling.py            # the full grid: 8 runs, about 10 min on 2 idle cores
    python bench/grpo_scaling.py --quick    # 3m only, 16 prompts (about 3 min)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from grpo_vs_trl import LAYOUTS  # noqa: E402
from report import build_record, load_average, run_script, text_table, write_record  # noqa: E402
from workload import SIZES, build_workload  # noqa: E402

FP32_BYTES = 4


@dataclass(frozen=True)
class Point:
    """One measured configuration."""

    size: str
    layout: str
    group: int
    max_new: int

    @property
    def name(self) -> str:
        return f"{self.size}_{self.layout}_g{self.group}_len{self.max_new}"


BASE = Point("3m", "dp2", 8, 64)
AXES = {"layout": ("layout", ("dp2", "tp2", "pp2")), "group": ("group", (4, 8, 16)),
        "response length": ("max_new", (32, 64, 128)), "model size": ("size", ("3m", "25m"))}


def grid(sizes: tuple[str, ...] = ("3m", "25m"), axes_wanted: tuple[str, ...] = tuple(AXES)) -> dict[str, list[Point]]:
    """{axis: the points along it} for the axes in ``axes_wanted``, each point varying one field of ``BASE``; model
    sizes restricted to ``sizes``."""
    axes = {}
    for axis, (field, values) in AXES.items():
        if axis not in axes_wanted:
            continue
        if field == "size":
            values = tuple(v for v in values if v in sizes)
        axes[axis] = [Point(**{**asdict(BASE), field: value}) for value in values]
    return axes


def unique_points(axes: dict[str, list[Point]]) -> list[Point]:
    """Every point of the grid once, in first-seen order (the base point sits on every axis)."""
    return list(dict.fromkeys(point for points in axes.values() for point in points))


def expected_sync_bytes(parameters: int, dtype_bytes: int = FP32_BYTES) -> int:
    """Bytes of one full weight sync: every HF parameter once (a tied LM head is the embedding, not sent twice)."""
    return parameters * dtype_bytes


def summarise(rows: list[dict], warmup: int = 1) -> dict:
    """Mean seconds per step and phase, sync bytes and tokens/s over the trainer's per-step metric rows after the
    first ``warmup``. ValueError when no step is left to measure."""
    measured = rows[warmup:]
    if not measured:
        raise ValueError(f"{len(rows)} step(s) logged, {warmup} of them warm-up: nothing to measure")

    def avg(key: str) -> float:
        return mean(row.get(key, 0.0) for row in measured)

    tokens, response_tokens = avg("perf/num_tokens"), avg("perf/num_response_tokens")
    return {
        "step_seconds": avg("timing_s/step"), "gen_seconds": avg("timing_s/gen"),
        "logprob_seconds": avg("timing_s/old_logprob"), "update_seconds": avg("timing_s/update"),
        "sync_seconds": avg("timing_s/sync"), "sync_bytes": avg("perf/sync_bytes"),
        "tokens_per_step": tokens, "response_tokens_per_step": response_tokens,
        "generated_tokens_per_s": response_tokens / avg("timing_s/gen"),
        "trained_tokens_per_s": tokens / avg("timing_s/update"), "steps_measured": len(measured),
    }


def measure(point: Point, args, work) -> dict:
    """Run ``point`` through ``bench/ours_grpo.py``; its summary with peak RSS and the load around it."""
    folder = args.work / "scaling" / point.name
    folder.mkdir(parents=True, exist_ok=True)
    tensor, pipeline = LAYOUTS[point.layout]
    out, load_before = folder / "ours.json", load_average()
    run_script("ours_grpo.py", "--model", str(work.model_dir), "--prompts", str(work.train_file),
               "--run-dir", str(folder / "run"), "--num-prompts", str(args.prompts), "--group", str(point.group),
               "--max-new", str(point.max_new), "--steps", str(args.steps), "--nproc", "2", "--tensor", str(tensor),
               "--pipeline", str(pipeline), "--out", str(out))
    raw = json.loads(out.read_text())
    return {**asdict(point), **summarise(raw["steps"]), "parameters": work.parameters,
            "expected_sync_bytes": expected_sync_bytes(work.parameters), "peak_rss_mb": raw["peak_rss_mb"],
            "processes": raw["processes"], "load_average": [load_before, load_average()]}


COLUMNS = [("model", "size", ""), ("layout", "layout", ""), ("G", "group", "d"), ("len", "max_new", "d"),
           ("step s", "step_seconds", ".2f"), ("gen s", "gen_seconds", ".2f"), ("update s", "update_seconds", ".2f"),
           ("sync s", "sync_seconds", ".3f"), ("sync MiB", "sync_mib", ".2f"), ("expected MiB", "expected_mib", ".2f"),
           ("gen tok/s", "generated_tokens_per_s", ".0f"), ("train tok/s", "trained_tokens_per_s", ".0f"),
           ("RSS MiB", "peak_rss_mb", ".0f"), ("load", "load", "")]


def table(axes: dict[str, list[Point]], results: dict[Point, dict]) -> str:
    """One block per axis, its points in order (the base point repeated on each)."""
    blocks = []
    for axis, points in axes.items():
        rows = [{**results[p], "sync_mib": results[p]["sync_bytes"] / 2**20,
                 "expected_mib": results[p]["expected_sync_bytes"] / 2**20,
                 "load": "-".join(f"{v:.1f}" for v in results[p]["load_average"])} for p in points]
        blocks.append(f"[{axis}]\n" + text_table(COLUMNS, rows))
    return "\n\n".join(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step (each sampled G times)")
    parser.add_argument("--steps", type=int, default=2, help="steps per point, the first one warm-up")
    parser.add_argument("--sizes", nargs="+", default=["3m", "25m"], choices=sorted(SIZES),
                        help="model sizes on the model-size axis")
    parser.add_argument("--axes", nargs="+", default=list(AXES), choices=list(AXES), help="axes to measure")
    parser.add_argument("--quick", action="store_true", help="3m only, 16 prompts")
    parser.add_argument("--work", type=Path, default=Path("/tmp/grpo_mega_bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/grpo_scaling.json")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.prompts = ["3m"], 16
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
    started, load_before = time.time(), load_average()
    axes = grid(tuple(args.sizes), tuple(args.axes))
    workloads = {size: build_workload(args.work / "workload", size) for size in {p.size for p in unique_points(axes)}}
    results = {}
    for point in unique_points(axes):
        results[point] = measure(point, args, workloads[point.size])
        print(f"{point.name}: {results[point]['step_seconds']:.2f} s/step", flush=True)
    record = build_record({
        "workload": {"prompts": args.prompts, "steps": args.steps, "warmup_steps": 1, "temperature": 1.0,
                     "updates_per_batch": 1, "kl": 0.0, "dtype": "float32", "processes": 2, "threads_per_process": 1,
                     "rollout_engine": "hf"},
        "base": asdict(BASE), "axes": {axis: [p.name for p in points] for axis, points in axes.items()},
        "results": [{"name": p.name, **r} for p, r in results.items()],
    }, started=started, load_before=load_before)
    print(table(axes, results))
    write_record(record, args.out)


if __name__ == "__main__":
    main()
