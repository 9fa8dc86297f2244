"""The multi-turn rollout on the hf engine with and without KV-cache continuation (issue 75, part 1): rollout seconds
per step, and the positions put through the model in prefill (several per row per forward pass) and in decode (one
per row), on the tool task with its tool SFT policy and the calculator.

Both arms are ``TurnLoopEngine(HFRolloutEngine(policy))`` over the same prompts, G, seed and settings: ``continued``
(the default: each row's cache kept across its tool call, ``generate_with_caches``) and ``recomputed`` (the turn
loop's path for engines that keep no cache: every later turn prefills each row's whole prefix). They alternate;
median and minimum of ``--repeats``, wall-clock and the process's CPU seconds (on a shared machine the CPU seconds
are the steadier figure). The trajectories of the two are compared token by token (they should be equal: the same
random numbers). The calculator is grpo-mega's built-in one (``build_toolset(["calculator"])``, which runs inline,
not in the sandbox): its seconds are reported apart. The policy defaults to the tool regime's SFT checkpoint of
``grpo-mega quickstart --regime tools`` run in /tmp/tr/full (``--checkpoint``, ``--model-dir``).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/turn_loop_kv.py --prompts 32 --group 8 --repeats 5 --threads 1
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/turn_loop_kv.py --prompts 32 --group 8 --repeats 3 --threads 1 \\
        --temperature 0 --out bench/results/turn_loop_kv_greedy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench.report import load_average, machine  # noqa: E402


def one_step(loop, engine, prompts, sampling) -> tuple[dict, list]:
    engine.forward_tokens = {"prefill": 0, "decode": 0}
    loop.pop_tool_seconds()
    started, cpu_started = time.perf_counter(), time.process_time()
    completions = loop.generate(prompts, sampling)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tool_seconds = loop.pop_tool_seconds()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tool_seconds": tool_seconds,
            **engine.forward_tokens}, completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="/tmp/tr/full/sft_tool_more/checkpoints/step_000400")
    parser.add_argument("--model-dir", default="/tmp/tr/full/model", help="the run's model folder: only for the "
                        "default --heldout (the policy's tokenizer and HF config come from its checkpoint)")
    parser.add_argument("--heldout", default=None, help="prompts file (default: MODEL_DIR/../data/heldout.jsonl)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=220, help="response tokens, tool turns included")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "turn_loop_kv.json")
    args = parser.parse_args()

    import torch

    from grpo_mega.parallel import init_distributed
    from grpo_mega.rollout.base import SamplingConfig
    from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
    from grpo_mega.tools import SandboxConfig, build_toolset
    from prm.policy import load_policy_rollout

    torch.set_num_threads(args.threads)
    heldout = Path(args.heldout or Path(args.model_dir).parent / "data" / "heldout.jsonl")
    init_distributed(1, 1, seed=0, device="cpu")  # one process: the forward engine the checkpoint loads into
    rollout = load_policy_rollout(args.checkpoint, generation_batch_size=64)  # the engine's default
    engine, tokenizer, model = rollout.engine, rollout.tokenizer, rollout.engine.model
    rows = [json.loads(line) for line in heldout.read_text().splitlines()[:args.prompts]]
    prompts = [tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]
    loop = TurnLoopEngine(engine, build_toolset(["calculator"], SandboxConfig()), tokenizer,
                          TurnLoopSettings(max_response_tokens=args.max_tokens, max_turns=args.max_turns))
    sampling = SamplingConfig(temperature=args.temperature, n=args.group, max_new_tokens=args.max_tokens,
                              seed=args.seed)
    runs: dict[str, list[dict]] = {"continued": [], "recomputed": []}
    trajectories = {}
    one_step(loop, engine, prompts[:2], sampling)  # warm-up
    for _ in range(args.repeats):
        for arm in runs:
            loop.continues_kv = arm == "continued"
            figures, completions = one_step(loop, engine, prompts, sampling)
            runs[arm].append(figures)
            trajectories[arm] = completions
    same = sum(a.response_ids == b.response_ids
               for a, b in zip(trajectories["continued"], trajectories["recomputed"]))
    completions = trajectories["continued"]
    calls = sum(len(turn.calls) for c in completions for turn in c.turns)
    arms = {arm: {"seconds_median": statistics.median(r["seconds"] for r in figures),
                  "seconds": [round(r["seconds"], 3) for r in figures],
                  "seconds_min": min(r["seconds"] for r in figures),
                  "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in figures),
                  "cpu_seconds_min": min(r["cpu_seconds"] for r in figures),
                  "cpu_seconds": [round(r["cpu_seconds"], 3) for r in figures],
                  "tool_seconds_median": statistics.median(r["tool_seconds"] for r in figures),
                  "prefill_positions": figures[-1]["prefill"], "decode_positions": figures[-1]["decode"]}
            for arm, figures in runs.items()}
    record = {
        "what": "rollout seconds per step of the multi-turn loop on the hf engine, each row's KV cache continued "
                "across tool calls vs every later turn's prefix recomputed; positions through the model (padding "
                "included) in prefill and decode",
        "command": "PYTHONPATH=$PWD python bench/turn_loop_kv.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "load_average": load_average(),
        "policy": {"checkpoint": str(args.checkpoint), "model_dir": str(args.model_dir),
                   "parameters": sum(p.numel() for p in model.parameters())},
        "workload": {"prompts": len(prompts), "group": args.group, "rollouts": len(completions),
                     "max_tokens": args.max_tokens, "max_turns": args.max_turns, "temperature": args.temperature,
                     "seed": args.seed, "repeats": args.repeats, "threads": args.threads,
                     "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "rollouts": {"tool_calls_per_rollout": round(calls / len(completions), 3),
                     "turns_per_rollout": round(sum(len(c.turns) for c in completions) / len(completions), 3),
                     "mean_response_tokens": round(sum(len(c.response_ids) for c in completions) / len(completions),
                                                   1),
                     "identical_trajectories": f"{same}/{len(completions)}"},
        "arms": arms,
        "speedup": arms["recomputed"]["seconds_median"] / arms["continued"]["seconds_median"],
        "cpu_speedup": arms["recomputed"]["cpu_seconds_median"] / arms["continued"]["cpu_seconds_median"],
        "cpu_speedup_of_minima": arms["recomputed"]["cpu_seconds_min"] / arms["continued"]["cpu_seconds_min"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("rollouts", "arms", "speedup", "cpu_speedup",
                                                 "cpu_speedup_of_minima")}, indent=2))


if __name__ == "__main__":
    main()
