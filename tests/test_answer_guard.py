"""The answer guard of process supervision (issue 47): nothing after the first final answer earns credit, and a
missing answer never pays, for every step-reward option and credit form, with a learned PRM's scores and with the
synthetic oracle's step rewards.

The groups are hand-built: four completions of the synthetic task "7 + 5, then * 3" (right, a wrong first step, a
wrong second step, right), scored by an arithmetic PRM stand-in (a right step 0.9, a wrong one 0.2, the right answer
0.8, a wrong one 0.1), one token per character plus an end-of-sequence token. Each invariant is checked with the
guard on and, where the old credit was gamed, shown to fail with it off, so that the checks can fail."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from grpo_mega.algo import cut_at_answer, process_advantages
from grpo_mega.config import ProcessRewardConfig
from grpo_mega.data.step_split import SYNTHETIC_STEP_PATTERN
from grpo_mega.reward.answer_span import final_answer_end
from grpo_mega.reward.synthetic import synthetic_step_reward
from grpo_mega.reward.types import SampleReward
from grpo_mega.stages.answer_guard import AnswerGuard
from grpo_mega.stages.process_reward import PRMStepRewards
from grpo_mega.stages.rollout import answer_metrics
from grpo_mega.stages.step_tokens import one_step_per_token, step_end_tokens

KINDS = ("score", "progress", "delta", "clip")
CREDITS = ("sum", "min")
PROBLEM = {"steps": [{"lhs": 7, "op": "+", "rhs": 5, "result": 12}, {"lhs": 12, "op": "*", "rhs": 3, "result": 36}]}
GROUP = [" Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36.",
         " Step 1: 7 + 5 = 13. Step 2: 13 * 3 = 39. The answer is 39.",
         " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 35. The answer is 35.",
         " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."]


# ----------------------------------------------------------------------------- where the answer ends
@pytest.mark.parametrize("text, expected_end", [
    (" Step 1: 7 + 5 = 12. The answer is 12. The answer is 12.", len(" Step 1: 7 + 5 = 12. The answer is 12.")),
    ("The answer is 3.5.\nThe answer is 3.5.", len("The answer is 3.5.")),
    ("The final answer is $\\boxed{\\frac{1}{2}}$. Check: ...", len("The final answer is $\\boxed{\\frac{1}{2}}$.")),
    ("So $x = \\boxed{4}$.\n\nWait, let me redo it: \\boxed{5}", len("So $x = \\boxed{4}$.")),
    ("12 * 3 = 36\n#### 36\nExtra text", len("12 * 3 = 36\n#### 36")),
    ("The answer is 7", len("The answer is 7")),
])
def test_the_default_locator_ends_the_first_answer_of_each_format(text, expected_end):
    assert final_answer_end(text) == expected_end


@pytest.mark.parametrize("text", ["", "Step 1: 7 + 5 = 12.", "so the answer is not obvious yet",
                                  "then \\boxed{4 at the length cap", "####"])
def test_no_answer_where_none_is_complete(text):
    assert final_answer_end(text) is None


def test_a_pattern_replaces_the_locator():
    assert final_answer_end("Result: 42 and more", r"Result: \d+") == len("Result: 42")
    assert final_answer_end("The answer is 42.", r"Result: \d+") is None
    with pytest.raises(ValueError, match="answer_pattern"):
        final_answer_end("x", "(")


# ----------------------------------------------------------------------------- the rules, by hand
def test_steps_are_cut_at_the_answer_and_a_missing_answer_gets_its_own_step():
    # steps ending at 10, 20, 30, 40; the answer ends at 25: the third step holds it and ends there, the fourth goes
    assert cut_at_answer([1, 2, 3, 4], [10, 20, 30, 40], 25, missing_value=0.0, missing_end=41) == \
        ([1.0, 2.0, 3.0], [10, 20, 25])
    assert cut_at_answer([1, 2], [10, 20], 20, missing_value=0.0, missing_end=21) == ([1.0, 2.0], [10, 20])
    assert cut_at_answer([1, 2], [10, 20], None, missing_value=-0.5, missing_end=21) == ([1.0, 2.0, -0.5], [10, 20, 21])


@pytest.mark.parametrize("credit", CREDITS)
def test_tokens_after_the_last_step_get_its_advantage_capped_at_zero(credit):
    # one group of two completions of 5 tokens, each with steps ending at tokens 1 and 2; rewards (1, 1) and (0, 0):
    # pooled mean 0.5, so normalised (without std) +0.5, +0.5 and -0.5, -0.5
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    ends = torch.tensor([[1, 2], [1, 2]])
    mask = torch.ones(2, 5)
    capped = process_advantages(rewards, ends, mask, 2, scale_by_std=False, credit=credit, after_last_step="capped")
    zero = process_advantages(rewards, ends, mask, 2, scale_by_std=False, credit=credit)
    first = [1.0, 1.0, 0.5] if credit == "sum" else [0.5, 0.5, 0.5]
    assert capped[0].tolist() == pytest.approx(first + [0.0, 0.0])  # a right answer's tail: 0, not its +0.5
    worst = -1.0 if credit == "sum" else -0.5
    assert capped[1].tolist() == pytest.approx([worst, worst, -0.5, -0.5, -0.5])  # a wrong one's: its -0.5
    assert zero[1, 3:].tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------- the group through the real stages
class ArithmeticPRM:
    """A PRM stand-in that knows arithmetic: a right step 0.9, a wrong one 0.2; the right answer 0.8, a wrong 0.1."""

    def score_steps(self, prompts, steps):
        scores = []
        for row in steps:
            row_scores = []
            for step in row:
                equation = re.search(r"(-?\d+) ([+*-]) (-?\d+) = (-?\d+)", step)
                answer = re.search(r"The answer is (-?\d+)", step)
                if equation:
                    lhs, op, rhs, result = equation.groups()
                    value = {"+": int(lhs) + int(rhs), "*": int(lhs) * int(rhs), "-": int(lhs) - int(rhs)}[op]
                    row_scores.append(0.9 if value == int(result) else 0.2)
                else:
                    row_scores.append(0.8 if answer and answer.group(1) == "36" else 0.1)
            scores.append(row_scores)
        return scores


EOS = 0


def _decode(ids):
    return "".join(chr(i) for i in ids if i != EOS)


def _token_steps(rewards, char_ends, texts):
    """Character ends -> token ends as the rollout stage maps them (a token per character, the end-of-sequence
    token after the text), one step per token."""
    rows_rewards, rows_ends = [], []
    for row_rewards, row_ends, text in zip(rewards, char_ends, texts):
        ids = [ord(c) for c in text] + [EOS]
        kept_rewards, kept_ends = one_step_per_token(row_rewards, step_end_tokens(_decode, ids, row_ends))
        rows_rewards.append(kept_rewards)
        rows_ends.append(kept_ends)
    width = max(max(len(r) for r in rows_rewards), 1)
    step_rewards = torch.zeros(len(texts), width)
    step_ends = torch.full((len(texts), width), -1, dtype=torch.long)
    for i, (r, e) in enumerate(zip(rows_rewards, rows_ends)):
        step_rewards[i, : len(r)] = torch.tensor(r)
        step_ends[i, : len(e)] = torch.tensor(e)
    return step_rewards, step_ends


def advantages(texts, *, source, kind="score", credit="sum", scale_by_std=True, guard=True) -> torch.Tensor:
    """Per-token advantages [G, T] of a group: the learned-PRM path (PRMStepRewards) or the oracle's
    (synthetic_step_reward), then the stage's token mapping and process_advantages."""
    answer_guard = AnswerGuard() if guard else None
    outcomes = [1.0 if "The answer is 36." in text[:(final_answer_end(text) or 0)] else 0.0 for text in texts]
    if source == "prm":
        settings = ProcessRewardConfig(source="prm", prm="unused", step_reward=kind, clip_eta=0.5,
                                       step_pattern=SYNTHETIC_STEP_PATTERN)
        rewards, ends, _ = PRMStepRewards(ArithmeticPRM(), settings, answer_guard)(
            ["Q"] * len(texts), texts, outcomes, [{}] * len(texts))
    else:
        results = []
        for text in texts:
            step = synthetic_step_reward("Q", text, "36", **PROBLEM)
            result = SampleReward(step.score, list(step.step_rewards), list(step.step_ends))
            results.append(answer_guard.guard_reward(result, text) if answer_guard else result)
        rewards, ends = [r.step_rewards for r in results], [r.step_ends for r in results]
    step_rewards, step_ends = _token_steps(rewards, ends, texts)
    mask = torch.zeros(len(texts), max(len(t) for t in texts) + 1)
    for i, text in enumerate(texts):
        mask[i, : len(text) + 1] = 1
    return process_advantages(step_rewards, step_ends, mask, len(texts), scale_by_std=scale_by_std, credit=credit,
                              after_last_step="capped" if guard else "zero")


def _raised(before: torch.Tensor, after: torch.Tensor, shared: int) -> float:
    """How far any of the first ``shared`` tokens' advantages rose (<= 0: none did)."""
    return float((after[:shared] - before[:shared]).max())


ARMS = [("prm", kind, credit) for kind, credit in itertools.product(KINDS, CREDITS)] + \
    [("oracle", "score", credit) for credit in CREDITS]


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("source, kind, credit", ARMS)
@pytest.mark.parametrize("row", range(4))
def test_text_after_the_answer_never_raises_a_token_of_its_completion(row, source, kind, credit, scale_by_std):
    """Answer repeats and an extra step after the answer (the `delta` hack): every token of the original completion
    keeps at most its advantage, and the appended tokens get at most what the original's end-of-sequence got."""
    text = GROUP[row]
    padded = list(GROUP)
    padded[row] = text + " The answer is %s. The answer is %s. Step 3: 36 + 0 = 36." % (text[-3:-1], text[-3:-1])
    options = dict(source=source, kind=kind, credit=credit, scale_by_std=scale_by_std)
    before, after = advantages(GROUP, **options)[row], advantages(padded, **options)[row]
    assert _raised(before, after, len(text)) <= 1e-6
    assert float(after[len(text): len(padded[row]) + 1].max()) <= float(before[len(text)]) + 1e-6
    assert float(before[len(text)]) <= 0.0  # the end-of-sequence token of a completion never earns credit


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("kind, credit", itertools.product(KINDS, CREDITS))
def test_without_the_guard_text_after_the_answer_paid(kind, credit, scale_by_std):
    """The same padding without the guard (the credit of earlier releases) and a learned PRM, which scores every
    answer sentence: the padded completion's tokens gain. (The synthetic oracle reads only up to its first answer.)"""
    source = "prm"
    padded = list(GROUP)
    padded[0] = GROUP[0] + " The answer is 36. The answer is 36. Step 3: 36 + 0 = 36."
    options = dict(source=source, kind=kind, credit=credit, scale_by_std=scale_by_std, guard=False)
    before, after = advantages(GROUP, **options)[0], advantages(padded, **options)[0]
    gain = max(_raised(before, after, len(GROUP[0])),
               float(after[len(GROUP[0]): len(padded[0])].max() - before[len(GROUP[0])]))
    assert gain > 0.05


@pytest.mark.parametrize("source, kind", [("prm", kind) for kind in KINDS] + [("oracle", "score")])
@pytest.mark.parametrize("row", range(4))
def test_leaving_the_answer_out_never_raises_a_token_with_summed_credit(row, source, kind):
    """The oracle arm's hack (no answer sentence): with the missing answer scored as a wrong one, no token before
    the answer gains, right or wrong answer (sum credit, Dr. GRPO's unscaled normalisation: see the next test)."""
    cut = list(GROUP)
    cut[row] = GROUP[row][: GROUP[row].index(" The answer")]
    options = dict(source=source, kind=kind, credit="sum", scale_by_std=False)
    before, after = advantages(GROUP, **options)[row], advantages(cut, **options)[row]
    assert _raised(before, after, len(cut[row])) <= 1e-6


def _gain_from_leaving_out_the_wrong_answer(source, kind, credit, guard):
    cut = list(GROUP)
    cut[1] = GROUP[1][: GROUP[1].index(" The answer")]
    options = dict(source=source, kind=kind, credit=credit, scale_by_std=True, guard=guard)
    return _raised(advantages(GROUP, **options)[1], advantages(cut, **options)[1], len(cut[1]))


@pytest.mark.parametrize("source, kind, credit", ARMS)
def test_leaving_a_wrong_answer_out_gains_little_with_std_scaling(source, kind, credit):
    """With the std-scaled, pooled normalisation a lowered reward can move the group's mean and spread enough to
    lift another step's normalised reward a little (measured: at most 0.07 on this group, under delta and under min
    credit); it is not the hack, which the next test shows."""
    assert _gain_from_leaving_out_the_wrong_answer(source, kind, credit, guard=True) <= 0.1


@pytest.mark.parametrize("source, kind", [("prm", kind) for kind in KINDS] + [("oracle", "score")])
def test_without_the_guard_leaving_a_wrong_answer_out_paid(source, kind):
    """Without the guard (earlier releases, sum credit) a wrong answer's negative reward was summed into every
    earlier token while a missing answer cost nothing: leaving it out raised them by 0.2 or more."""
    assert _gain_from_leaving_out_the_wrong_answer(source, kind, "sum", guard=False) > 0.2


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("row", range(4))
def test_useless_right_steps_before_the_answer_do_not_raise_delta_credit(row, scale_by_std):
    """`delta`: two correct steps that change nothing, added before the answer, do not raise the completion's summed
    credit (the advantage of its first token, the sum of its normalised step rewards)."""
    text = GROUP[row]
    cut = text.index(" The answer")
    value = text[cut + 15: cut + 17]
    padded = list(GROUP)
    padded[row] = text[:cut] + f" Step 3: {value} + 0 = {value}. Step 4: {value} * 1 = {value}." + text[cut:]
    options = dict(source="prm", kind="delta", scale_by_std=scale_by_std)
    assert float(advantages(padded, **options)[row, 0]) <= float(advantages(GROUP, **options)[row, 0]) + 1e-6


def test_the_rollout_counts_missing_answers_and_text_after_the_answer():
    texts = [GROUP[0], GROUP[0] + " The answer is 36.", "Step 1: 7 + 5 = 12.", GROUP[1] + "\n"]
    assert answer_metrics(texts, None, SYNTHETIC_STEP_PATTERN) == {
        "rollout/no_answer_fraction": 0.25, "rollout/text_after_answer_fraction": 0.25,
        "rollout/pieces_per_completion": (3 + 4 + 1 + 3) / 4}
    custom = AnswerGuard(answer_pattern=r"Step 1: [^.]*\.")
    assert answer_metrics(texts, custom, SYNTHETIC_STEP_PATTERN)["rollout/text_after_answer_fraction"] == 0.75
