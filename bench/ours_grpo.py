"""The benchmark workload through ``grpo-mega train``: per-step phase seconds from the trainer's own metrics.

Settings mirror ``bench/trl_grpo.py``: the workload's HF folder as config, tokenizer and initial weights; its first
``num_prompts`` prompts in a file of their own (so every step samples exactly those prompts); G completions of up to
``max_new`` tokens at temperature 1 over the full vocabulary; no KL; one optimizer step per batch (on-policy, so
no old-log-prob pass); token-mean loss; constant lr; clip 1.0; no dynamic sampling (every group is trained);
fp32 on the CPU, the hf rollout engine, ``nproc`` gloo processes with one thread each.

Micro-batches of at most ``--micro-tokens`` tokens (default 1024, as in the quickstart config; 4096 before): with two
processes on two cores the 25M model's update ran 40-47 GFLOP/s per process at 4096-token micro-batches and
58-62 at 512-1024 (``bench/profile_update.py --size 25m --rows 128 --threads 1`` twice at once; alone, 59-62 at
either size). A 4096 x 1536 fp32 activation is 25 MB: two processes' working sets overflow the shared 32 MB L3
and the element-wise ops (add, mul, silu) become memory-bound (add 7x, silu 6x slower in the profile).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from grpo_mega.run.metrics import read_metrics  # noqa: E402

MICRO_TOKENS = 1024
"""Default token budget of a training micro-batch (see the module docstring)."""


def write_prompt_file(train_file: Path, count: int, out: Path) -> Path:
    """The first ``count`` rows of ``train_file`` as their own jsonl (one fixed batch of prompts)."""
    lines = Path(train_file).read_text(encoding="utf-8").splitlines()[:count]
    if len(lines) < count:
        raise ValueError(f"{train_file}: {len(lines)} rows, the workload needs {count}")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def run_ours(model_dir: Path, prompt_file: Path, run_dir: Path, *, num_prompts: int, group: int, max_new: int,
             steps: int, nproc: int = 2, tensor: int = 2, pipeline: int = 1, lr: float = 5e-5,
             micro_tokens: int = MICRO_TOKENS, overrides: tuple[str, ...] = ()) -> dict:
    """Train ``steps`` GRPO steps; returns the per-step metric rows (``timing_s/*``, ``perf/*``) and peak RSS."""
    command = [
        sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(ROOT / "configs/quickstart_grpo.yaml"),
        "--nproc", str(nproc), f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}",
        f"model.hf_config={model_dir}", f"model.init_from={model_dir}", f"data.train_file={prompt_file}",
        f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.progress_bar=false",
        # a rerun starts afresh, the earlier run moved aside to <run_dir>.old-<time> (the run-folder guard)
        "trainer.resume=none", "trainer.overwrite=true", "trainer.eval_every=0", "trainer.save_every=0",
        f"algorithm.rollout_batch_size={num_prompts}", f"algorithm.num_return_sequences_in_group={group}",
        f"algorithm.response_length={max_new}", "algorithm.dynamic_sampling=false", "algorithm.ppo_epochs=1",
        "algorithm.loss_agg_mode=token-mean", "rollout.temperature=1.0", f"rollout.generation_batch_size={num_prompts}",
        "reward.function=workload:digit_reward", f"optim.lr={lr}", "optim.clip_grad=1.0",
        "optim.decay_style=constant", f"parallel.max_tokens_per_micro_batch={micro_tokens}", *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"grpo-mega train failed ({done.returncode}):\n{done.stdout[-4000:]}")
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "timing_s/step" in row]
    return {"command": " ".join(command[1:]), "steps": rows, "processes": nproc,
            # the largest single process of the run (ru_maxrss of the waited-for descendants)
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--micro-tokens", type=int, default=MICRO_TOKENS, help="token budget of a training micro-batch")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the per-step rows and peak RSS")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.run_dir.parent.mkdir(parents=True, exist_ok=True)
    prompt_file = write_prompt_file(args.prompts, args.num_prompts, args.run_dir.parent / "prompts.jsonl")
    result = run_ours(args.model, prompt_file, args.run_dir, num_prompts=args.num_prompts, group=args.group,
                      max_new=args.max_new, steps=args.steps, nproc=args.nproc, tensor=args.tensor,
                      pipeline=args.pipeline, micro_tokens=args.micro_tokens, overrides=tuple(args.overrides))
    for row in result["steps"]:
        print(json.dumps({k: round(v, 3) for k, v in row.items() if k.startswith(("timing_s", "perf"))}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(args.out)


if __name__ == "__main__":
    main()
