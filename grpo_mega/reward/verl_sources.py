"""``reward.function: verl_default``: the verifier chosen by the row's ``data_source``, as verl's
``default_compute_score`` chooses it for its math datasets, on grpo-mega's own answer checks (``math_answer``).

The name is verl's (``verl.utils.reward_score.default_compute_score``, what a verl run uses when it sets no
``custom_reward_function``), so that a verl dataset (parquet rows with ``data_source``, ``prompt``,
``reward_model.ground_truth``) trains with the reward it was made for. Each source keeps verl's answer form and
reward values; the comparison is math-verify's (``answers_match``), which accepts equal values written differently
("0.5" and "\\frac{1}{2}") where verl compares normalised strings:

===========================================================  ==============================  ===============
``data_source``                                               the completion's answer         reward
===========================================================  ==============================  ===============
``openai/gsm8k``                                              after its last ``####``        1 right, 0 else
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,   its last ``\\boxed{}``          1 right, 0 else
``HuggingFaceH4/MATH-500``
``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``   its last ``Answer: ...`` line   1 right, -1 else
                                                              (in its last 300 characters)
``numina_aops_forum``, ``numina_synthetic_math``,             ``####``, ``\\boxed{}``, else   1 right, 0 else
``numina_amc_aime``, ``numina_synthetic_amc``,                its last number
``numina_cn_k12``, ``numina_olympiads``
===========================================================  ==============================  ===============

verl's code and search sources (``codecontests``, ``searchR1_*``, ``hiyouga/geometry3k``, ...) need verifiers
grpo-mega does not have: such a row is an error naming its ``data_source`` (give ``reward.function`` a verl
``compute_score`` of your own for them).
"""

from __future__ import annotations

import re
from typing import Callable

from grpo_mega.reward.math_answer import answers_match, extract_boxed

_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL_CHARS = 300  # verl's math_dapo reads the last 300 characters (MATH-500's longest answer has 159)


def gsm8k_score(completion: str, ground_truth: str) -> float:
    """1.0 when the completion has a ``####`` answer equal to the gold, else 0.0 (verl's strict GSM8K form)."""
    return 1.0 if "####" in completion and answers_match(ground_truth, completion) else 0.0


def math_score(completion: str, ground_truth: str) -> float:
    """1.0 when the completion's last ``\\boxed{}`` equals the gold, else 0.0 (verl's MATH form)."""
    return 1.0 if extract_boxed(completion) is not None and answers_match(ground_truth, completion) else 0.0


def dapo_score(completion: str, ground_truth: str) -> float:
    """1.0 when the last ``Answer: x`` line in the completion's last 300 characters equals the gold, else -1.0
    (DAPO's reward, verl's math_dapo)."""
    found = _DAPO_ANSWER.findall(completion[-_DAPO_TAIL_CHARS:])
    if not found:
        return -1.0
    answer = found[-1].strip().rstrip(".").strip("$ ")
    return 1.0 if answers_match(ground_truth, f"\\boxed{{{answer}}}") else -1.0


def numina_score(completion: str, ground_truth: str) -> float:
    """1.0 when the completion's final answer (``####``, ``\\boxed{}``, else its last number) equals the gold."""
    return 1.0 if answers_match(ground_truth, completion) else 0.0


VERL_MATH_SOURCES: dict[str, Callable[[str, str], float]] = {
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math_dapo": dapo_score,
    "math": dapo_score,
    "math_dapo_reasoning": dapo_score,
    "numina_aops_forum": numina_score,
    "numina_synthetic_math": numina_score,
    "numina_amc_aime": numina_score,
    "numina_synthetic_amc": numina_score,
    "numina_cn_k12": numina_score,
    "numina_olympiads": numina_score,
}
"""verl's math ``data_source`` names -> the score of (completion, gold); ``aime*`` names are DAPO's too."""


def scorer_of(data_source: object) -> Callable[[str, str], float]:
    """The score function of a row's ``data_source``; ValueError naming it when verl_default has none."""
    if isinstance(data_source, str):
        if data_source in VERL_MATH_SOURCES:
            return VERL_MATH_SOURCES[data_source]
        if data_source.startswith("aime"):
            return dapo_score
    raise ValueError(
        f"verl_default has no verifier for data_source {data_source!r}: it knows verl's math sources "
        f"({', '.join(VERL_MATH_SOURCES)}, aime*); for other sources set reward.function to your own verl "
        "compute_score (/path/to/file.py:compute_score)")


def verl_default_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """The reward verl's ``default_compute_score`` gives a math row, by its ``data_source`` column (see the
    module's table); the gold is ``answer`` (verl's ``reward_model.ground_truth``)."""
    if "data_source" not in extra:
        raise ValueError(f"verl_default picks the verifier by the row's data_source column, and this row has none "
                         f"(its columns: {sorted(extra)})")
    if answer is None:
        nested = extra.get("reward_model")
        answer = nested.get("ground_truth") if isinstance(nested, dict) else None
    if answer is None:
        raise ValueError("verl_default: the row has no gold answer: set data.answer_field (verl's rows keep it in "
                         "reward_model.ground_truth)")
    return scorer_of(extra["data_source"])(completion, str(answer))
