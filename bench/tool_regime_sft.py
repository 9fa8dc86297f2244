"""The tool regime's SFT policies measured (issue 75, part 5): is the synthetic task one that needs its tool?

Runs ``grpo-mega quickstart --regime tools`` (data, tokenizer, text-only SFT and tool SFT on the same problems;
skipped with ``--reuse`` when the run directory has its summary.json), then measures on held-out prompts, through
grpo-mega's own rollout (the hf engine that ``grpo-mega eval`` loads a checkpoint into) and, for the tool policy, its
multi-turn turn loop (``grpo_mega.rollout.turn_loop`` with the ``calculator`` tool of ``grpo_mega.tools``, the
``<tool_response>`` fallback turns the tool SFT demonstrations are written in), as ``rollout.multi_turn`` runs it:

- the text-only SFT policy's sampled pass@1 (temperature 1);
- the tool SFT policy's sampled pass@1 WITH the calculator (the turn loop);
- the tool SFT policy's sampled pass@1 WITHOUT it (one turn: it writes on past its calls, nothing appended: what it
  knows in its head).

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

from grpo_mega.data.synthetic import read_jsonl  # noqa: E402
from grpo_mega.reward.synthetic import synthetic_reward  # noqa: E402
from grpo_mega.rollout.base import SamplingConfig  # noqa: E402

MEASURES = (("text_sft", "text", False), ("tool_sft_with_calculator", "tool", True),
            ("tool_sft_without_calculator", "tool", False))
"""(figure, SFT arm, whether the policy's calls are run: the turn loop with the calculator)."""
MAX_TURNS = 6
"""Assistant turns of a rollout (a three-step problem takes three calls and the answer: four)."""


def with_calculator(engine, tokenizer, max_tokens: int):
    """``engine`` inside grpo-mega's turn loop with the calculator (``rollout.multi_turn`` with ``tools:
    [calculator]``, ``format: hermes``, no chat template: the ``<tool_response>`` turns SFT trained on)."""
    from grpo_mega.rollout.tool_turns import tool_turns_for
    from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
    from grpo_mega.tools import SandboxConfig, build_toolset

    settings = TurnLoopSettings(max_response_tokens=max_tokens, max_turns=MAX_TURNS, format="hermes")
    return TurnLoopEngine(engine, build_toolset(["calculator"], SandboxConfig()), tokenizer, settings,
                          tool_turns_for("hermes", tokenizer, use_chat_template=False))


def measure(engine, tokenizer, problems, *, seed: int, max_tokens: int) -> dict:
    """Sampled pass@1 (temperature 1, one rollout per problem, one ``generate`` call with ``seed``) and the
    rollouts' tool figures over ``problems``."""
    begin = time.perf_counter()
    prompt_ids = [list(tokenizer.encode(problem.prompt)) for problem in problems]
    completions = engine.generate(prompt_ids, SamplingConfig(temperature=1.0, max_new_tokens=max_tokens, seed=seed))
    rewards, calls, with_call, errors, finished, tokens, tool_tokens = [], 0, 0, {}, 0, 0, 0
    for problem, completion in zip(problems, completions):
        rewards.append(synthetic_reward(problem.prompt, completion.text, str(problem.answer)))
        made = [call for turn in completion.turns or [] for call in turn.calls]
        calls += len(made)
        with_call += int(bool(made) or "<tool_call>" in completion.text)
        for call in made:
            if call.error is not None:
                errors[call.error] = errors.get(call.error, 0) + 1
        finished += int(completion.finish_reason == "eos")
        tokens += len(completion.response_ids)
        tool_tokens += len(completion.policy_mask) - sum(completion.policy_mask)
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
    parser.add_argument("--batch", type=int, default=64, help="rollouts the hf engine decodes at once")
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
    problems = read_jsonl(summary["heldout_file"])[: args.prompts]
    checkpoints = dict(summary["sft_checkpoints"])
    for item in args.checkpoint:
        arm, _, path = item.partition("=")
        if arm not in checkpoints or not path:
            parser.error(f"--checkpoint {item!r}: expected ARM=PATH with ARM one of {sorted(checkpoints)}")
        checkpoints[arm] = str(Path(path).resolve())
    from grpo_mega.parallel import destroy_distributed, init_distributed
    from prm.policy import load_policy_rollout

    init_distributed(1, 1, seed=args.seed, device="cpu")  # one process: the forward engine a checkpoint loads into
    figures = {}
    try:
        for name, arm, calculator in MEASURES:
            if name not in args.measures:
                continue
            rollout = load_policy_rollout(checkpoints[arm], generation_batch_size=args.batch)
            engine = rollout.engine
            if calculator:
                engine = with_calculator(engine, rollout.tokenizer, args.max_tokens)
            figures[name] = measure(engine, rollout.tokenizer, problems, seed=args.seed, max_tokens=args.max_tokens)
            print(name, json.dumps(figures[name]), flush=True)
    finally:
        destroy_distributed()
    result = {
        "what": "the tool regime's SFT policies on held-out prompts: sampled pass@1 (temperature 1) of the text-only "
                "SFT policy, and of the tool SFT policy with the calculator (grpo-mega's multi-turn turn loop, "
                "rollout.multi_turn with tools [calculator], on the hf rollout engine) and without it (one turn)",
        "command": f"PYTHONPATH=$PWD OMP_NUM_THREADS={torch_threads} python bench/tool_regime_sft.py "
                   + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "quickstart_command": f"grpo-mega quickstart --regime tools --run-dir {args.run_dir}",
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs shared with other jobs, torch threads {torch_threads}",
        "figures": figures,
        "gap_points": (round(100 * (figures["tool_sft_with_calculator"]["pass_at_1"]
                                    - figures["text_sft"]["pass_at_1"]), 1)
                       if {"text_sft", "tool_sft_with_calculator"} <= set(figures) else None),
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
