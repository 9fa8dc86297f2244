"""Turn-level accuracy and AUROC of PRMs on the tool task's turn-split rows (``grpo-mega prm label --steps turns``)
against the task's oracle, and how well the Monte-Carlo labels themselves agree with it.

The oracle judges each assistant turn of a calculator trajectory (``grpo_mega.data.tool_task``) as the tool task's
per-turn checker does (``reward.function: tool_task_turns``, called here on the turns of the stored tokens, their
calls parsed back from the text): a turn is right when every "Step N: a op b = c" it writes is right
(``check_steps``: the problem's N-th operation on the true carried value), its calculator call, if any, is valid and
computes the chain's next operation (the problem's (s+1)-th operation on the true carried value, s the steps written
so far; a + b and a * b either way round), the final answer, if it states it, is the gold one, and it does one of
these (a void turn is wrong).

    python bench/prm_turn_eval.py --rows HELDOUT_LABELS.jsonl --data heldout.jsonl --tokenizer TOKENIZER \
        --scores trained=SCORES.jsonl untrained=SCORES0.jsonl --out result.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpo_mega.reward.tool_task import tool_task_turn_reward
from grpo_mega.rollout.base import decode_response
from grpo_mega.rollout.tool_calls import parse_turn
from prm.metrics import auroc
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps


def oracle_turns(row: dict, steps: list[dict], tokenizer) -> list[bool]:
    """The oracle's verdict on each turn step of a stored row: ``reward.function=tool_task_turns``
    (grpo_mega.reward.tool_task) given the turns the trainer would give it, their calls parsed back from the text."""
    turn_steps = TurnSteps.from_row(row[TURN_STEPS_FIELD], len(row["completions"]))
    ids = turn_steps.response_ids
    completion = decode_response(tokenizer, ids)
    turns = []
    for first, last in zip(turn_steps.step_starts, turn_steps.step_ends):
        start, end = len(decode_response(tokenizer, ids[:first])), len(decode_response(tokenizer, ids[:last + 1]))
        text = completion[start:end]
        calls = []
        if "</tool_call>" in text:
            call = parse_turn(text, "hermes").call
            calls.append({"name": call.name, "arguments": call.arguments, "error": None} if call is not None
                         else {"name": None, "arguments": None, "error": "invalid_call"})
        turns.append({"text": text, "start": start, "end": end, "calls": calls})
    verdict = tool_task_turn_reward(row["prompt"], completion, row["answer"],
                                    steps=steps, turns=turns)
    return [reward == 1.0 for reward in verdict.turn_rewards]


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", required=True, help="turn-split rows (prm label --steps turns)")
    parser.add_argument("--data", required=True, help="the tool task's dataset the rows' prompts come from")
    parser.add_argument("--tokenizer", required=True, help="the policy's tokenizer folder")
    parser.add_argument("--scores", nargs="*", default=[], help="NAME=PATH of prm score outputs of --rows")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    problems = {}
    for line in Path(args.data).read_text().splitlines():
        record = json.loads(line)
        problems[record["prompt"]] = record["steps"]
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines()]
    truth = [oracle_turns(row, problems[row["prompt"]], tokenizer) for row in rows]
    flat = [t for turns in truth for t in turns]
    hard = [bool(v) for row in rows for v in row["labels"]]
    soft = [float(v) for row in rows for v in row["soft_labels"]]
    result = {
        "rows": len(rows), "turns": len(flat), "oracle_right_fraction": sum(flat) / len(flat),
        "solution_accuracy": sum(row["outcome"] > 0.5 for row in rows) / len(rows),
        "mc_hard_label_agreement": sum(h == t for h, t in zip(hard, flat)) / len(flat),
        "mc_soft_label_auroc": auroc(soft, flat),
        "scorers": {},
    }
    for spec in args.scores:
        name, path = spec.split("=", 1)
        scored = [json.loads(line)["step_scores"] for line in Path(path).read_text().splitlines()]
        if [len(s) for s in scored] != [len(t) for t in truth]:
            raise SystemExit(f"{path}: its step counts differ from {args.rows}'s")
        values = [v for s in scored for v in s]
        result["scorers"][name] = {
            "auroc": auroc(values, flat),
            "accuracy_at_0.5": sum((v > 0.5) == t for v, t in zip(values, flat)) / len(flat),
            "auroc_vs_mc_hard_labels": auroc(values, hard),
        }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
