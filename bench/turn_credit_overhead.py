"""What turn credit costs the trainer per step on the CPU: ``group_advantages`` of a synthetic multi-turn batch with
outcome supervision, and with ``process_reward.steps: turns`` under each ``algorithm.turn_credit`` form, plus the
``turn_credit/*`` metrics (``grpo_mega.stages.turn_credit_metrics``). No model: the batch is made up (0/1 outcomes,
0/1 turn rewards, fixed turn and tool-turn lengths).

    PYTHONPATH=. .venv/bin/python bench/turn_credit_overhead.py [--prompts 64] [--group 8] [--turns 4]

Prints one line per form: milliseconds per call (mean of 5 after a warm-up) and the metrics.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from grpo_mega.config import AlgorithmConfig
from grpo_mega.rollout.base import Completion, TurnRecord
from grpo_mega.stages import group_advantages
from grpo_mega.stages.rollout import RolloutBatch
from grpo_mega.stages.turn_credit_metrics import turn_credit_metrics


def synthetic_batch(prompts: int, group: int, turns: int, turn_tokens: int, tool_tokens: int) -> RolloutBatch:
    random.seed(0)
    completions, outcomes, rewards = [], [], []
    for _ in range(prompts * group):
        records, mask, pos = [], [], 0
        for k in range(turns):
            last = k == turns - 1
            records.append(TurnRecord(pos, pos + turn_tokens, "answer" if last else "tool_call",
                                      tool_end=None if last else pos + turn_tokens + tool_tokens))
            mask += [1] * turn_tokens + ([] if last else [0] * tool_tokens)
            pos = len(mask)
        completions.append(Completion(0, [1], [5] * pos, [0.0] * pos, "", "eos", response_mask=mask, turns=records))
        rewards.append([float(random.random() < 0.6) for _ in range(turns)])
        outcomes.append(float(random.random() < 0.4))
    scores = torch.tensor(outcomes)
    ends = [[t.end - 1 for t in c.turns] for c in completions]
    return RolloutBatch([None] * prompts, completions, scores, scores, rewards, ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=60)
    parser.add_argument("--tool-tokens", type=int, default=15)
    args = parser.parse_args()
    batch = synthetic_batch(args.prompts, args.group, args.turns, args.turn_tokens, args.tool_tokens)
    for form in ("outcome", "bounded", "sum"):
        process = form != "outcome"
        alg = AlgorithmConfig(num_return_sequences_in_group=args.group,
                              supervision="process" if process else "outcome",
                              turn_credit=form if process else "bounded")
        shown = batch if process else RolloutBatch(batch.records, batch.completions, batch.rewards, batch.scores)
        group_advantages(shown, alg)
        start = time.perf_counter()
        for _ in range(5):
            group_advantages(shown, alg)
        seconds = (time.perf_counter() - start) / 5
        start = time.perf_counter()
        metrics = turn_credit_metrics(shown, alg) if process else {}
        metric_seconds = time.perf_counter() - start
        print(f"{form}: group_advantages {seconds * 1e3:.1f} ms, turn_credit_metrics {metric_seconds * 1e3:.1f} ms "
              f"({len(batch.completions)} completions x {args.turns} turns); {metrics}", flush=True)


if __name__ == "__main__":
    main()
