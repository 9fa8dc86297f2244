"""Start-up: seconds from a command's start to its first training step, by phase, per command, and what a training
rank's imports cost against ``import torch`` alone (issue 40).

Each command runs one step of the quickstart task (its tiny Qwen2-shaped policy, random weights) in a fresh run
folder, as a user starts it (``python -m grpo_mega.cli ...``, relaunched under torchrun); its first metrics row holds
the ranks' ``startup_s/*`` phases (``grpo_mega.perf.startup``: launch = the command's own process and torchrun
before the rank started, imports, distributed, data, model_build, load, rollout_engine, other). The command's whole
wall time (to its exit: the step, the final save, the shutdown) is beside it. The imports are timed as fresh
interpreters, ``python -c "import X"`` (interpreter start included, ``python -c pass`` reported too), each the
median of ``--repeats``.

    python bench/startup.py                    # ~4 min on 2 cores; writes bench/results/startup.json
    python bench/startup.py --repeats 1 --commands train_1   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
IMPORTS = ["pass", "import torch", "import transformers", "import megatron.core", "import grpo_mega.trainer",
           "import grpo_mega.cli"]
SHARED = ["trainer.total_steps=1", "trainer.save_every=0", "trainer.progress_bar=false", "trainer.tensorboard=false",
          "parallel.device=cpu"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def time_imports(repeats: int) -> dict[str, float]:
    """Median seconds of ``python -c <statement>`` per statement (a fresh interpreter each time)."""
    medians = {}
    for statement in IMPORTS:
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", statement], check=True, env=_env(), cwd=ROOT, capture_output=True)
            seconds.append(time.perf_counter() - start)
        medians[statement] = statistics.median(seconds)
    return medians


def _task(root: Path) -> dict[str, Path]:
    """The quickstart model, its GRPO / SFT data and a planted-error PRM training file under ``root``."""
    from grpo_mega.data.synthetic import read_jsonl
    from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model
    from prm.data import write_stepwise
    from prm.synthetic import planted_error_examples

    model, train_file, _ = build_data_and_model(root, QuickstartPlan(num_train=64, num_heldout=8))
    prm_file = root / "prm_train.jsonl"
    write_stepwise(prm_file, planted_error_examples(read_jsonl(train_file)[:32], seed=1))
    return {"model": model, "train": train_file, "prm_train": prm_file}


def commands(task: dict[str, Path], run_root: Path) -> dict[str, list[str]]:
    """name -> ``grpo_mega.cli`` arguments (each with its own run folder)."""
    model = [f"model.hf_config={task['model']}"]

    def run(name: str) -> str:
        return f"trainer.run_dir={run_root / name}"

    grpo = [*model, f"data.train_file={task['train']}", "data.eval_file=null", "algorithm.rollout_batch_size=4",
            "algorithm.num_return_sequences_in_group=2", "algorithm.response_length=8",
            "algorithm.dynamic_sampling=false", "trainer.eval_every=0", *SHARED]
    train = ["train", "--config", str(CONFIGS / "quickstart_grpo.yaml")]
    return {
        "train_1": [*train, "--nproc", "1", *grpo, run("train_1")],
        "train_2": [*train, "--nproc", "2", *grpo, run("train_2")],
        "sft_1": ["sft", "--config", str(CONFIGS / "quickstart_sft.yaml"), "--nproc", "1", *model,
                  f"data.train_file={task['train']}", "trainer.batch_size=8", *SHARED, run("sft_1")],
        "prm_train_1": ["prm", "train", "--config", str(CONFIGS / "quickstart_prm.yaml"), "--nproc", "1", *model,
                        f"data.train_file={task['prm_train']}", "data.eval_file=null", "trainer.batch_size=8",
                        *SHARED, run("prm_train_1")],
    }


def run_command(name: str, args: list[str], run_root: Path) -> dict[str, float]:
    """One run of ``args``: its wall seconds and the first metrics row's start-up phases."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "grpo_mega.cli", *args], env=_env(), cwd=ROOT,
                            capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    first = json.loads((run_root / name / "metrics.jsonl").read_text().splitlines()[0])
    phases = {key.split("/", 1)[1]: value for key, value in first.items() if key.startswith("startup_s/")}
    if not phases:
        raise RuntimeError(f"{name}: no startup_s/* in its first metrics row: {sorted(first)}")
    return {"wall_s": wall, **phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per import and per command (median)")
    parser.add_argument("--commands", nargs="*", default=None, help="a subset of: train_1 train_2 sft_1 prm_train_1")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup.json")
    args = parser.parse_args(argv)

    imports = time_imports(args.repeats)
    with tempfile.TemporaryDirectory(prefix="grpo-mega-startup-") as folder:
        root = Path(folder)
        task = _task(root / "task")
        results = {}
        for name in args.commands or list(commands(task, root)):
            runs = []
            for repeat in range(args.repeats):
                run_root = root / "runs" / f"r{repeat}"
                arguments = commands(task, run_root)[name]
                runs.append(run_command(name, arguments, run_root))
            results[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}

    torch_s, rank_s = imports["import torch"], imports["import grpo_mega.trainer"]
    record = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "load_average_at_start": os.getloadavg()},
        "repeats": args.repeats, "imports_s": imports, "rank_imports_over_torch": rank_s / torch_s,
        "commands": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")

    print(f"imports (python -c, median of {args.repeats}):")
    for statement, seconds in imports.items():
        print(f"  {statement:<28} {seconds:6.2f} s")
    print(f"  a training rank's imports / import torch: {rank_s / torch_s:.2f}x")
    phases = ["launch", "imports", "distributed", "data", "model_build", "load", "rollout_engine", "other", "total"]
    print(f"\n{'command':<12}" + "".join(f"{p:>15}" for p in phases) + f"{'wall':>8}")
    for name, row in results.items():
        print(f"{name:<12}" + "".join(f"{row.get(p, 0.0):>15.2f}" for p in phases) + f"{row['wall_s']:>8.1f}")
    print(f"\n{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
