"""Step rewards from PRM step scores (``process_reward.step_reward``: score / progress / delta / clip) against
hand-computed cases: several steps, one step, none; the max-steps cap; the telescoping suffix sums each option is
chosen for; and through the process advantages with the sum and PURE's min-form credit."""

from __future__ import annotations

import pytest
import torch

from grpo_mega.algo import STEP_REWARDS, group_start_values, process_advantages, step_rewards_from_scores
from grpo_mega.config import ConfigError, GRPOConfig, ProcessRewardConfig, load_config, validate
from grpo_mega.data.step_split import SYNTHETIC_STEP_PATTERN
from grpo_mega.stages.process_reward import PRMStepRewards

SCORES = [0.9, 0.6, 0.2]


@pytest.mark.parametrize("kind, start, expected", [
    ("score", 0.0, [0.9, 0.6, 0.2]),
    ("progress", 0.5, [0.4, -0.3, -0.4]),     # s_k - s_{k-1}, s_0 = 0.5
    ("delta", 0.0, [0.3, 0.4, 0.2]),          # s_k - s_{k+1}, last s_K
    ("clip", 0.0, [0.0, 0.0, -0.3]),          # min(s_k - 0.5, 0)
])
def test_each_option_on_three_steps(kind, start, expected):
    assert step_rewards_from_scores(SCORES, kind, start=start, clip_eta=0.5) == pytest.approx(expected)


@pytest.mark.parametrize("kind, expected", [("score", [0.7]), ("progress", [0.45]), ("delta", [0.7]),
                                            ("clip", [-0.1])])
def test_one_step_and_no_step(kind, expected):
    assert step_rewards_from_scores([0.7], kind, start=0.25, clip_eta=0.8) == pytest.approx(expected)
    assert step_rewards_from_scores([], kind, start=0.25) == []


def _close(rows, expected_rows):
    assert [len(row) for row in rows] == [len(row) for row in expected_rows]
    assert [x for row in rows for x in row] == pytest.approx([x for row in expected_rows for x in row], abs=1e-6)


def _suffix_sums(values):
    return [sum(values[k:]) for k in range(len(values))]


def test_the_suffix_sums_telescope_as_the_options_promise():
    scores = [0.8, 0.3, 0.95, 0.4, 0.6]
    # delta: the credit from step k on is s_k, however many steps follow
    assert _suffix_sums(step_rewards_from_scores(scores, "delta")) == pytest.approx(scores)
    # progress: s_K - s_{k-1}
    starts = [0.5, *scores[:-1]]
    assert _suffix_sums(step_rewards_from_scores(scores, "progress", start=0.5)) == pytest.approx(
        [scores[-1] - before for before in starts])
    # score: padding a solution with right steps (0.9 each) raises the first token's credit; delta does not
    padded = [0.9, 0.9, 0.9, *scores]
    assert sum(padded) > sum(scores)
    assert _suffix_sums(step_rewards_from_scores(padded, "delta"))[0] == pytest.approx(0.9)
    # clip: no step earns a positive reward, so extra steps never raise the credit
    assert max(step_rewards_from_scores(padded, "clip", clip_eta=0.5)) == 0.0


def test_unknown_option_and_non_finite_start_are_refused():
    with pytest.raises(ValueError, match="step reward must be one of"):
        step_rewards_from_scores(SCORES, "sum")
    with pytest.raises(ValueError, match="finite s_0"):
        step_rewards_from_scores(SCORES, "progress", start=float("nan"))
    assert STEP_REWARDS == ("score", "progress", "delta", "clip")


def test_progress_starts_from_the_mean_outcome_of_each_prompts_group():
    assert group_start_values(["a", "a", "b", "b", "a"], [1.0, 0.0, 1.0, 1.0, 0.0]) == [0.5, 0.5, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="3 prompts but 2"):
        group_start_values(["a", "a", "b"], [1.0, 0.0])


def test_delta_through_the_process_advantages_with_sum_and_min_credit():
    """Completion A: scores [0.9, 0.3], steps ending at response tokens 1 and 3; B: one step [0.8] ending at token
    2. Delta rewards A [0.6, 0.3], B [0.8]; pooled mean 1.7 / 3; no std scaling: n_A = [0.0333, -0.2667],
    n_B = [0.2333]."""
    rewards = torch.tensor([step_rewards_from_scores([0.9, 0.3], "delta"),
                            step_rewards_from_scores([0.8], "delta") + [0.0]])
    ends = torch.tensor([[1, 3], [2, -1]])
    mask = torch.ones(2, 4)
    mean = 1.7 / 3
    n_a, n_b = [0.6 - mean, 0.3 - mean], 0.8 - mean
    summed = process_advantages(rewards, ends, mask, 2, scale_by_std=False)
    _close(summed.tolist(), [[n_a[0] + n_a[1]] * 2 + [n_a[1]] * 2, [n_b] * 3 + [0.0]])
    least = process_advantages(rewards, ends, mask, 2, scale_by_std=False, credit="min")
    _close(least.tolist(), [[min(n_a)] * 2 + [n_a[1]] * 2, [n_b] * 3 + [0.0]])


class IndexScorer:
    """Scores step j of every completion 0.9 - 0.2 j."""

    def score_steps(self, prompts, steps):
        return [[0.9 - 0.2 * j for j in range(len(row))] for row in steps]


SOLUTION = " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."


@pytest.mark.parametrize("kind, expected", [
    ("score", [[0.9, 0.7], [0.9, 0.7]]),
    ("progress", [[0.9 - 0.5, -0.2], [0.9 - 0.5, -0.2]]),   # s_0: the two completions' mean outcome, 0.5
    ("delta", [[0.2, 0.7], [0.2, 0.7]]),
    ("clip", [[0.0, -0.1], [0.0, -0.1]]),
])
def test_the_prm_stage_applies_the_option_after_the_max_steps_cap(kind, expected):
    """Three steps capped at two (the answer sentence joins step 2) before scoring; then the option; then the
    weight (0.5) and the outcome on the last step (only for the right completion)."""
    settings = ProcessRewardConfig(source="prm", prm="unused", step_reward=kind, clip_eta=0.8, max_counted_steps=2,
                                   step_pattern=SYNTHETIC_STEP_PATTERN)
    rewards, ends, _ = PRMStepRewards(IndexScorer(), settings)(["Q", "Q"], [SOLUTION, SOLUTION], [1.0, 0.0],
                                                                [{}, {}])
    _close(rewards, expected)
    assert ends == [[20, len(SOLUTION)]] * 2
    weighted = ProcessRewardConfig(source="prm", prm="unused", step_reward=kind, clip_eta=0.8, max_counted_steps=2,
                                   step_score_weight=0.5, outcome_on_last_step=True, step_pattern=SYNTHETIC_STEP_PATTERN)
    rewards, _, _ = PRMStepRewards(IndexScorer(), weighted)(["Q", "Q"], [SOLUTION, SOLUTION], [1.0, 0.0], [{}, {}])
    _close(rewards, [[0.5 * expected[0][0], 0.5 * expected[0][1] + 1.0], [0.5 * expected[1][0], 0.5 * expected[1][1]]])


def test_the_config_checks_the_option():
    base = ["model.hf_config=x", "data.train_file=y", "algorithm.supervision=process"]
    prm = [*base, "process_reward.source=prm", "process_reward.prm=p"]
    assert load_config(GRPOConfig, None, [*prm, "process_reward.step_reward=delta"], validate).process_reward \
        .step_reward == "delta"
    with pytest.raises(ConfigError, match="process_reward.step_reward"):
        load_config(GRPOConfig, None, [*prm, "process_reward.step_reward=sum"], validate)
    with pytest.raises(ConfigError, match="clip_eta=1.5 must be in"):
        load_config(GRPOConfig, None, [*prm, "process_reward.clip_eta=1.5"], validate)
    # without a PRM the option means nothing: reset with a warning (issue 51), not refused
    steps = [*base, "reward.function=synthetic_steps", "process_reward.step_reward=progress"]
    assert load_config(GRPOConfig, None, steps, validate).process_reward.step_reward == "score"
