"""The implicit PRM's figures on the held-out evaluation's completions (``eval/implicit_prm/*``, every evaluation of
a synchronous run): whether its summed reward predicts each completion's outcome, and, on the synthetic task (rows
with the ``steps`` field), how well its step scores find the first wrong step against the task's step checker.

A step is predicted wrong when its score is below the threshold of ``implicit_prm.step_value``: a ``sum`` below 0
(the step lowered the implicit Q-value, the predicted log-odds of a right answer), a ``probability`` below 0.5 (the
Q-value at its end says the answer is more likely wrong than right). The steps are the ones process supervision
scores: the text through the first final answer (the answer guard's cut; the whole text without the guard) split by
``process_reward.step_pattern``; their truth is ``prm.synthetic.true_step_labels``. Reported, as the learned PRM's
evaluation reports them (``prm.metrics``): ProcessBench's F1 over the completions (the first wrong step found
exactly on a wrong solution, no wrong step predicted on a right one) with its two accuracies, and the step-level F1
of detecting wrong steps over all steps pooled, at that fixed threshold; and ProcessBench's F1 at a threshold picked
on a seeded dev share of the completions (``tuned_*``), as the learned PRM's evaluation of the policy's solutions
picks its own. (A sign test flags a right solution of six steps whenever one step's sum dips below 0: a weak
implicit PRM's fixed-threshold F1 is near 0 however well it ranks steps.)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from grpo_mega.algo.implicit_reward import implicit_step_scores, outcome_prediction_accuracy
from grpo_mega.data.step_split import step_char_ends
from grpo_mega.data.synthetic import Problem
from grpo_mega.stages.process_reward import segment_completion
from grpo_mega.stages.step_tokens import step_end_tokens
from prm.examples import first_error_of
from prm.evaluate import split_dev
from prm.metrics import choose_threshold, predicted_first_error, processbench_f1, step_classification
from prm.synthetic import true_step_labels

WRONG_BELOW = {"sum": 0.0, "probability": 0.5}
"""The score below which a step is predicted wrong, per ``implicit_prm.step_value``."""


def scored_pieces(text: str, answer_end: int | None, pattern: str, max_counted_steps: int) -> list[str]:
    """The pieces of ``text`` a step score is given to: through ``answer_end`` when given, split by ``pattern``."""
    scored = text if answer_end is None else text[:answer_end]
    return segment_completion(scored, pattern, max_counted_steps)


def piece_scores(token_rewards: torch.Tensor, pieces: Sequence[str], response_ids: Sequence[int],
                 decode: Callable[[list[int]], str], step_value: str) -> list[float]:
    """Each piece's score from one completion's response token rewards ([T]) by ``implicit_step_scores`` (a piece
    that ends in the token of the piece before it has no token of its own: sum 0)."""
    ends = step_end_tokens(decode, response_ids, step_char_ends(list(pieces)))
    return implicit_step_scores(token_rewards.float()[None], torch.tensor([ends]), step_value)[0].tolist()


def step_detection(scores: list[list[float]], truths: list[list[bool]], step_value: str, *,
                   seed: int = 0) -> dict[str, float]:
    """ProcessBench F1 (with its error / correct accuracies) and the step-level F1 of wrong-step detection, over the
    completions with at least one scored piece, at the fixed threshold of ``step_value``; and ProcessBench F1 at
    the threshold a seeded dev share (``DEV_FRACTION`` of the completions) picks, on the rest, as the learned PRM's
    evaluation picks its own (``tuned_*``). Figures without a defined value (e.g. no wrong solution) left out."""
    threshold = WRONG_BELOW[step_value]
    rows = [(row, truth) for row, truth in zip(scores, truths) if truth]
    if not rows:
        return {}
    bench = processbench_f1([predicted_first_error(row, threshold) for row, _ in rows],
                            [first_error_of(truth) for _, truth in rows])
    steps = step_classification([row for row, _ in rows], [truth for _, truth in rows], threshold)
    figures = {"processbench_f1": bench["f1"], "processbench_error_accuracy": bench["error_accuracy"],
               "processbench_correct_accuracy": bench["correct_accuracy"], "step_f1": steps["step_f1"],
               "step_accuracy": steps["step_accuracy"], **tuned_processbench(rows, threshold, seed)}
    return {f"eval/implicit_prm/{key}": float(value) for key, value in figures.items() if value is not None}


DEV_FRACTION = 0.25
"""The share of the evaluated completions whose ProcessBench F1 picks the tuned threshold (the rest report it)."""


def tuned_processbench(rows: list[tuple[list[float], list[bool]]], fixed: float, seed: int) -> dict[str, float]:
    """ProcessBench F1 on the non-dev rows at the threshold that maximises it on a seeded dev share, of the fixed
    threshold and the dev step scores' 5 %, 10 %, ..., 95 % quantiles (the implicit PRM's scale is not a
    probability's: the learned PRM's 0.05 grid would not fit it); {} with fewer than 2 rows."""
    dev, test = split_dev(len(rows), DEV_FRACTION, seed)
    if not dev or not test:
        return {}
    dev_scores = [rows[index][0] for index in dev]
    pooled = sorted(score for row in dev_scores for score in row)
    candidates = sorted({fixed, *(pooled[min(len(pooled) - 1, int(q * len(pooled) / 20))] for q in range(1, 20))})
    threshold, _ = choose_threshold(dev_scores, [first_error_of(rows[index][1]) for index in dev], candidates)
    result = processbench_f1([predicted_first_error(rows[index][0], threshold) for index in test],
                             [first_error_of(rows[index][1]) for index in test])
    return {"tuned_processbench_f1": result["f1"], "tuned_processbench_error_accuracy": result["error_accuracy"],
            "tuned_processbench_correct_accuracy": result["correct_accuracy"], "tuned_processbench_threshold": threshold}


def outcome_figures(token_rewards: torch.Tensor, outcomes: Sequence[float]) -> dict[str, float]:
    """The share of held-out completions whose outcome the summed reward predicts (``sum_t r_t > 0`` for right)."""
    labels = torch.tensor([float(score) for score in outcomes])
    return {"eval/implicit_prm/outcome_accuracy": outcome_prediction_accuracy(token_rewards, labels)}


def synthetic_truth(extra: dict, pieces: Sequence[str]) -> list[bool]:
    """The step checker's label of every piece; [] without pieces."""
    return true_step_labels(Problem.from_record({"steps": extra["steps"]}), pieces) if pieces else []
