"""The answer guard of process supervision (``algorithm.answer_guard``): nothing after a completion's first final
answer earns credit, and a completion without a final answer is scored as one with a wrong answer.

Two suffix-sum credit forms were gamed without it (docs/results.md): under ``delta`` the policy wrote more answer
sentences after its answer (each one a step the PRM scores well), and the oracle arm learned to leave the answer
sentence out, because a wrong answer's negative normalised reward was summed into every earlier step while a missing
answer cost nothing. The rules, per completion, in any coordinate (character offsets or token indices):

- the steps are cut at the end of the first final answer: a step that ends after it is dropped, except the step
  that holds the answer's end, which now ends there (:func:`cut_at_answer`);
- a completion with no final answer gets a final-answer step of its own after its last step, with the value a
  wrong answer gets (``missing_value``): a PRM score of 0, or the reward function's reward of a wrong answer
  (:func:`cut_at_answer` with ``answer_end=None``);
- the tokens after the last step (the text after the answer, the end-of-sequence token) get
  ``min(A_last, 0)``, ``A_last`` the advantage of the answer's last token, instead of 0
  (:func:`grpo_mega.algo.process_advantages` with ``after_last_step="capped"``): never more than the completion
  would get without them, and a wrong answer's tail is pushed down with it.
"""

from __future__ import annotations

from typing import Sequence


def cut_at_answer(values: Sequence[float], ends: Sequence[int], answer_end: int | None, *,
                  missing_value: float, missing_end: int) -> tuple[list[float], list[int]]:
    """A completion's step ``values`` and (exclusive, strictly increasing) step ``ends`` with the guard's rules:
    cut at ``answer_end``; with ``answer_end`` None, a missing-answer step of ``missing_value`` ending at
    ``missing_end`` appended (``missing_end`` past the last step's end: e.g. beyond the text, so that it lands on
    the end-of-sequence token)."""
    if len(values) != len(ends):
        raise ValueError(f"{len(values)} step values but {len(ends)} step ends")
    if answer_end is None:
        return [*map(float, values), float(missing_value)], [*map(int, ends), int(missing_end)]
    kept_values, kept_ends = [], []
    for value, end in zip(values, ends):
        kept_values.append(float(value))
        kept_ends.append(min(int(end), int(answer_end)))
        if end >= answer_end:
            break
    return kept_values, kept_ends
