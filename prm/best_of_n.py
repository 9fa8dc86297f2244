"""Best-of-N reranking of a policy's samples by the PRM (``grpo-mega prm eval --policy ... --prompts ...``).

N samples per prompt from the policy's rollout engine; each is split into steps, scored by the PRM and checked
by the verifier. ``prm_at_n``: the sample with the best aggregated step score (min, last or product) is right;
``maj_at_n``: the most frequent final answer is right; ``pass_at_n``: some sample is right. On the synthetic task
the samples also have ground-truth step labels, so the PRM's ProcessBench F1 on the policy's own solutions is
reported too (``policy_processbench_*``, threshold chosen on a seeded dev share of the prompts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from grpo_mega.data.synthetic import Problem, parse_solution
from grpo_mega.reward.math_answer import extract_predicted_answer
from prm.evaluate import processbench_report, split_dev
from prm.examples import first_error_of
from prm.metrics import best_of_n
from prm.synthetic import true_step_labels


def final_answer(completion: str, synthetic: bool) -> str | None:
    """The answer a sample states: "The answer is N" on the synthetic task, else the math verifier's extraction."""
    if synthetic:
        answer = parse_solution(completion).answer
        return None if answer is None else str(answer)
    return extract_predicted_answer(completion)


def candidate_groups(
    answers: Sequence[str | None], correct: Sequence[bool], step_scores: Sequence[Sequence[float]], n: int
) -> list[list[dict]]:
    """Samples grouped by prompt (rows p*n .. p*n+n-1) as the candidates of ``prm.metrics.best_of_n``. A sample
    without steps (an empty completion) gets the step score 0: it is never preferred."""
    candidates = [
        {"answer": answer, "correct": bool(ok), "step_scores": list(scores) if scores else [0.0]}
        for answer, ok, scores in zip(answers, correct, step_scores)
    ]
    return [candidates[start : start + n] for start in range(0, len(candidates), n)]


def best_of_n_report(args, scorer) -> dict:
    """Sample, score and rerank (collective); see the module docstring for the keys."""
    import torch.distributed as dist

    from grpo_mega.data.prompts import load_prompt_dataset
    from grpo_mega.data.step_split import split_steps
    from grpo_mega.reward import get_reward_function, score_across_ranks
    from grpo_mega.rollout.base import SamplingConfig
    from grpo_mega.rollout.distributed import generate_across_ranks
    from grpo_mega.data.step_split import default_step_pattern
    from prm.policy import load_policy_rollout

    policy = load_policy_rollout(args.policy, generation_batch_size=64)
    records = load_prompt_dataset(args.prompts, policy.tokenizer, prompt_length=512, on_bad_row=args.on_bad_row,
                                  use_chat_template=False).records[: args.max_prompts]
    pattern = args.step_pattern or default_step_pattern(r.extra for r in records)
    synthetic = all("steps" in r.extra for r in records)
    n = args.n
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=n)
    completions = generate_across_ranks(policy.engine, [r.prompt_ids for r in records], sampling,
                                        call_seed=args.seed + 7919)
    texts = [c.text for c in completions]
    rows = [records[i // n] for i in range(len(texts))]
    rewards = score_across_ranks(get_reward_function(args.reward), [r.prompt for r in rows], texts,
                                 [r.answer for r in rows], [r.extra for r in rows])
    correct = [reward.score > 0.5 for reward in rewards]
    steps = [split_steps(text, pattern) if text.strip() else [] for text in texts]
    step_scores = scorer.score_steps([r.prompt for r in rows], steps)
    answers = [final_answer(text, synthetic) for text in texts]

    report = dict(best_of_n(candidate_groups(answers, correct, step_scores, n)))
    report.update(best_of_n_prompts=len(records), best_of_n_sample_accuracy=sum(correct) / len(correct),
                  prm_scoring_seconds=scorer.last_seconds)
    truth = None
    if synthetic:
        truth = [true_step_labels(Problem.from_record(row.extra), row_steps) if row_steps else []
                 for row, row_steps in zip(rows, steps)]
        report.update(_policy_processbench(step_scores, truth, n, dev_fraction=args.dev_fraction, seed=args.seed))
    if args.samples_out and dist.get_rank() == 0:
        _write_samples(Path(args.samples_out), rows, texts, steps, step_scores, correct, truth)
    return report


def _policy_processbench(step_scores, truth, n: int, *, dev_fraction: float, seed: int) -> dict:
    """ProcessBench F1 on the policy's own solutions (those with steps); the dev share is split by prompt."""
    prompts = len(step_scores) // n
    dev_prompts, _ = split_dev(prompts, dev_fraction, seed)
    dev_prompts = set(dev_prompts)
    dev, test = ([], []), ([], [])
    for index, (scores, labels) in enumerate(zip(step_scores, truth)):
        if not labels:
            continue
        target = dev if index // n in dev_prompts else test
        target[0].append(scores)
        target[1].append(first_error_of(labels))
    result = processbench_report(test[0], test[1], dev[0], dev[1])
    return {f"policy_{key}": value for key, value in result.items()}


def _write_samples(path: Path, rows, texts, steps, step_scores, correct, truth) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for index, (row, text) in enumerate(zip(rows, texts)):
            line = {"prompt": row.prompt, "source": row.source, "completion": text, "steps": steps[index],
                    "step_scores": step_scores[index], "correct": correct[index]}
            if truth is not None:
                line["true_labels"] = truth[index]
            handle.write(json.dumps(line) + "\n")
