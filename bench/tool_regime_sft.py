"""The tool regime's SFT policies measured (issue 75, part 5): is the synthetic task one that needs its tool?

Runs ``grpo-mega quickstart --regime tools`` (data, tokenizer, text-only SFT and tool SFT on the same problems;
skipped with ``--reuse`` when the run directory has its summary.json), then measures on held-out prompts, with the
evaluation harness of ``bench/tool_regime_eval.py`` (which supplies the calculator's exact answers until the
multi-turn rollout loop replaces it):

- the text-only SFT policy's sampled pass@1 (temperature 1);
- the tool SFT policy's sampled pass@1 WITH the calculator's answers supplied after each ``</tool_call>``;
- the tool SFT policy's sampled pass@1 WITHOUT them (it writes on past its calls: what it knows in its head).

Writes bench/results/tool_regime_sft.json (every figure with the command that produced it).

    PYTHONPATH=$PWD python bench/tool_regime_sft.py --run-dir runs/tool_regime
    PYTHONPATH=$PWD python bench/tool_regime_sft.py --run-dir runs/tool_regime --reuse --prompts 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tool_regime_eval import load_sft_policy, rollout  # noqa: E402

from grpo_mega.data.synthetic import read_jsonl  # noqa: E402
from grpo_mega.data.tokenizer import load_tokenizer  # noqa: E402
from grpo_mega.reward.synthetic import synthetic_reward  # noqa: E402

MEASURES = (("text_sft", "text", True), ("tool_sft_answers_supplied", "tool", True),
            ("tool_sft_without_answers", "tool", False))
"""(figure, SFT arm, whether the calculator's answers are supplied)."""


def measure(model, tokenizer, problems, *, seed: int, supply_answers: bool, max_tokens: int) -> dict:
    """Sampled pass@1 and the trajectories' tool figures over ``problems`` (one rollout each, seed ``seed + i``)."""
    begin = time.perf_counter()
    rewards, calls, with_call, errors, finished, tokens, tool_tokens = [], 0, 0, {}, 0, 0, 0
    for index, problem in enumerate(problems):
        prompt_ids = list(tokenizer.encode(problem.prompt))
        trajectory = rollout(model, tokenizer, prompt_ids, seed=seed + index, supply_answers=supply_answers,
                             max_tokens=max_tokens)
        text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
        rewards.append(synthetic_reward(problem.prompt, text, str(problem.answer)))
        calls += trajectory.calls
        with_call += int(trajectory.calls > 0 or "<tool_call>" in text)
        for kind, count in trajectory.errors.items():
            errors[kind] = errors.get(kind, 0) + count
        finished += int(trajectory.finished)
        tokens += len(trajectory.response_ids)
        tool_tokens += trajectory.mask.count(0)
    n = len(problems)
    mean = sum(rewards) / n
    return {"pass_at_1": round(mean, 4), "standard_error": round(math.sqrt(mean * (1 - mean) / n), 4),
            "prompts": n, "rollouts_with_a_tool_call": round(with_call / n, 4),
            "tool_calls_per_rollout": round(calls / n, 3), "tool_errors": errors,
            "ended_with_eos": round(finished / n, 4), "mean_response_tokens": round(tokens / n, 1),
            "tool_token_share": round(tool_tokens / max(tokens, 1), 4),
            "seconds": round(time.perf_counter() - begin, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/tool_regime")
    parser.add_argument("--reuse", action="store_true", help="measure the SFT policies of an existing run")
    parser.add_argument("--sft-steps", type=int, default=None, help="override the plan's SFT steps (both arms)")
    parser.add_argument("--prompts", type=int, default=300, help="held-out prompts per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=220, help="response tokens, tool turns included")
    parser.add_argument("--measures", nargs="+", default=[name for name, _, _ in MEASURES],
                        choices=[name for name, _, _ in MEASURES])
    parser.add_argument("--checkpoint", action="append", default=[], metavar="ARM=PATH",
                        help="measure this SFT checkpoint or run directory for arm text|tool instead of the run's "
                             "(e.g. a longer SFT started from it with model.init_from)")
    parser.add_argument("--out", default="bench/results/tool_regime_sft.json")
    args = parser.parse_args()
    torch_threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    import torch

    torch.set_num_threads(torch_threads)
    from dataclasses import replace

    from grpo_mega.quickstart.tool_regime import TOOLS, run_tool_regime

    plan = TOOLS if args.sft_steps is None else replace(TOOLS, sft_steps=args.sft_steps)
    run_dir = Path(args.run_dir).resolve()
    if not (args.reuse and (run_dir / "summary.json").is_file()):
        run_tool_regime(run_dir, plan)
    summary = json.loads((run_dir / "summary.json").read_text())
    tokenizer = load_tokenizer(summary["model"])
    problems = read_jsonl(summary["heldout_file"])[: args.prompts]
    checkpoints = dict(summary["sft_checkpoints"])
    for item in args.checkpoint:
        arm, _, path = item.partition("=")
        if arm not in checkpoints or not path:
            parser.error(f"--checkpoint {item!r}: expected ARM=PATH with ARM one of {sorted(checkpoints)}")
        checkpoints[arm] = str(Path(path).resolve())
    figures = {}
    for name, arm, supply in MEASURES:
        if name not in args.measures:
            continue
        model = load_sft_policy(checkpoints[arm], summary["model"])
        figures[name] = measure(model, tokenizer, problems, seed=args.seed, supply_answers=supply,
                                max_tokens=args.max_tokens)
        print(name, json.dumps(figures[name]), flush=True)
    result = {
        "what": "the tool regime's SFT policies on held-out prompts: sampled pass@1 (temperature 1) of the text-only "
                "SFT policy, and of the tool SFT policy with and without the calculator's answers supplied by "
                "bench/tool_regime_eval.py's harness (exact integer arithmetic in-process; the multi-turn rollout "
                "loop will replace it)",
        "command": f"PYTHONPATH=$PWD OMP_NUM_THREADS={torch_threads} python bench/tool_regime_sft.py "
                   + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "quickstart_command": f"grpo-mega quickstart --regime tools --run-dir {args.run_dir}",
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs shared with other jobs, torch threads {torch_threads}",
        "figures": figures,
        "gap_points": (round(100 * (figures["tool_sft_answers_supplied"]["pass_at_1"]
                                    - figures["text_sft"]["pass_at_1"]), 1)
                       if {"text_sft", "tool_sft_answers_supplied"} <= set(figures) else None),
        "checkpoints": checkpoints,
        "text_sft_pass_at_1_grpo_mega_eval": summary["text_sft_pass_at_1"],
        "plan": summary["plan"],
        "quickstart_stage_seconds": summary["stage_seconds"],
        "quickstart_wall_seconds": summary["wall_seconds"],
        "seed": args.seed,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
