"""Step rewards from a PRM for process-supervised GRPO: segmentation, the guards, metrics, and the config checks.

The scorer here is a small deterministic stand-in for ``prm.scoring.StepScorer`` (it scores a step by its text), so
the expected rewards can be worked out by hand; the real PRM runs in tests/test_prm_commands.py.
"""

from __future__ import annotations

import pytest

from grpo_mega.config import ConfigError, GRPOConfig, ProcessRewardConfig, load_config, validate
from grpo_mega.data.step_split import DOUBLE_NEWLINE_PATTERN, SYNTHETIC_STEP_PATTERN
from grpo_mega.stages.process_reward import PRMScoringError, PRMStepRewards, segment_completion, shape_step_rewards

SOLUTION = " Step 1: 7 + 5 = 12. Step 2: 12 * 3 = 36. The answer is 36."


class TextScorer:
    """Scores a step 0.9 when it contains "= 12" or "is 36", 0.2 otherwise; records what it was asked."""

    def __init__(self):
        self.calls = []

    def score_steps(self, prompts, steps):
        self.calls.append((list(prompts), [list(s) for s in steps]))
        return [[0.9 if ("= 12" in step or "is 36" in step) else 0.2 for step in row] for row in steps]


def test_segmentation_keeps_the_answer_sentence_as_a_step_and_caps_merge_the_tail():
    assert segment_completion(SOLUTION, SYNTHETIC_STEP_PATTERN) == [
        " Step 1: 7 + 5 = 12.", " Step 2: 12 * 3 = 36.", " The answer is 36."]
    # at most 2 counted steps: the answer sentence joins step 2
    assert segment_completion(SOLUTION, SYNTHETIC_STEP_PATTERN, max_counted_steps=2) == [
        " Step 1: 7 + 5 = 12.", " Step 2: 12 * 3 = 36. The answer is 36."]
    # no separator: one step, the whole completion; an empty completion has none
    assert segment_completion("just 36", DOUBLE_NEWLINE_PATTERN) == ["just 36"]
    assert segment_completion("  ", DOUBLE_NEWLINE_PATTERN) == []


def test_guards_and_outcome_on_the_last_step():
    off = ProcessRewardConfig()
    assert shape_step_rewards([0.9, 0.2], 1.0, off) == [0.9, 0.2]
    few = ProcessRewardConfig(min_steps=3, few_steps_reward=0.0)
    assert shape_step_rewards([0.9, 0.8], 1.0, few) == [0.0, 0.0]  # 2 < 3 steps: the PRM's scores are replaced
    assert shape_step_rewards([0.9, 0.8, 0.7], 1.0, few) == [0.9, 0.8, 0.7]
    assert shape_step_rewards([0.9, 0.2], 1.0, ProcessRewardConfig(outcome_on_last_step=True)) == [0.9, 1.2]
    assert shape_step_rewards([], 1.0, ProcessRewardConfig(outcome_on_last_step=True)) == []


def test_step_score_weight_scales_the_prm_scores_but_not_the_outcome():
    weighted = ProcessRewardConfig(outcome_on_last_step=True, step_score_weight=0.25)
    assert shape_step_rewards([0.8, 0.4], 1.0, weighted) == pytest.approx([0.2, 1.1])
    assert shape_step_rewards([0.8, 0.4], 0.0, weighted) == pytest.approx([0.2, 0.1])
    assert shape_step_rewards([0.8, 0.4], 1.0, ProcessRewardConfig(step_score_weight=0.0)) == [0.0, 0.0]


def test_prm_shaping_options_are_ignored_with_a_warning_where_no_prm_scores_the_steps(caplog):
    """Issue 51: a PRM config switched to outcome supervision or to the step function (``process_reward.source=
    function``) keeps running: the options that shape a PRM's scores are reset, with one warning naming them."""
    base = ["model.hf_config=x", "data.train_file=y", "algorithm.supervision=process",
            "reward.function=synthetic_steps"]
    for option, default in (("outcome_on_last_step=true", False), ("step_score_weight=0.5", 1.0),
                            ("max_counted_steps=4", 0), ("min_steps=2", 0), ("step_reward=progress", "score")):
        key = option.split("=")[0]
        caplog.clear()
        cfg = load_config(GRPOConfig, None, [*base, "process_reward.source=function", f"process_reward.{option}"],
                          validate)
        assert getattr(cfg.process_reward, key) == default
        assert [record.levelname for record in caplog.records] == ["WARNING"]
        assert f"ignoring process_reward.{key}=" in caplog.text and "uses no PRM" in caplog.text
    with pytest.raises(ConfigError, match="step_score_weight=-1.0 must be >= 0"):
        load_config(GRPOConfig, None, [*base, "process_reward.source=prm", "process_reward.prm=p",
                                       "process_reward.step_score_weight=-1"], validate)


def test_prm_step_rewards_score_every_step_once_and_report_metrics():
    scorer = TextScorer()
    source = PRMStepRewards(scorer, ProcessRewardConfig(source="prm", prm="unused"))
    texts = [SOLUTION, " Step 1: 7 + 5 = 13. The answer is 13.", ""]
    rewards, ends, metrics = source(["Q: a", "Q: a", "Q: a"], texts, [1.0, 0.0, 0.0], [{"steps": []}] * 3)
    assert rewards == [[0.9, 0.2, 0.9], [0.2, 0.2], []]
    assert ends == [[20, 41, 59], [20, 38], []]
    assert [texts[0][:e] for e in ends[0]] == [" Step 1: 7 + 5 = 12.", SOLUTION[:41], SOLUTION]
    assert len(scorer.calls) == 1  # one batched call per rollout
    assert metrics["prm/steps_per_completion"] == pytest.approx(5 / 3)
    assert metrics["prm/no_step_fraction"] == pytest.approx(1 / 3)
    assert metrics["prm/score_mean"] == pytest.approx((0.9 * 2 + 0.2 * 3) / 5)
    assert metrics["prm/last_step_score"] == pytest.approx((0.9 + 0.2) / 2)
    assert metrics["prm/min_step_score"] == pytest.approx(0.2)
    assert metrics["timing_s/prm"] >= 0


def test_config_needs_process_supervision_and_a_prm_path():
    base = ["model.hf_config=x", "data.train_file=y", "process_reward.source=prm"]
    with pytest.raises(ConfigError, match="algorithm.supervision=process"):
        load_config(GRPOConfig, None, [*base, "process_reward.prm=p"], validate)
    with pytest.raises(ConfigError, match="process_reward.prm"):
        load_config(GRPOConfig, None, [*base, "algorithm.supervision=process"], validate)
    with pytest.raises(ConfigError, match="algorithm.step_credit"):
        load_config(GRPOConfig, None, ["model.hf_config=x", "data.train_file=y", "algorithm.step_credit=max"],
                    validate)
    cfg = load_config(GRPOConfig, None, [*base, "process_reward.prm=p", "algorithm.supervision=process",
                                         "algorithm.step_credit=min"], validate)
    assert cfg.process_reward.prm == "p" and cfg.algorithm.step_credit == "min"


class BrokenScorer:
    """A PRM that gives a NaN to the second step of the second completion, or raises when ``fail`` is set."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def score_steps(self, prompts, steps):
        if self.fail:
            raise RuntimeError("device lost")
        return [[float("nan") if (row == 1 and index == 1) else 0.7 for index, _ in enumerate(s)]
                for row, s in enumerate(steps)]


def test_a_nan_from_the_prm_stops_the_step_naming_the_completion_and_step():
    source = PRMStepRewards(BrokenScorer(), ProcessRewardConfig(source="prm", prm="unused"))
    with pytest.raises(PRMScoringError, match=r"non-finite score \(nan\) to step 2 of completion 1 .*'Q: b'.*"
                                              r"Step 2: 12 \* 3 = 36"):
        source(["Q: a", "Q: b"], [SOLUTION, SOLUTION], [1.0, 1.0], [{"steps": []}] * 2)


def test_on_error_zero_scores_the_failed_completion_zero_and_counts_it():
    source = PRMStepRewards(BrokenScorer(), ProcessRewardConfig(source="prm", prm="unused", on_error="zero"))
    rewards, _, metrics = source(["Q: a", "Q: b"], [SOLUTION, SOLUTION], [1.0, 1.0], [{"steps": []}] * 2)
    assert rewards == [[0.7, 0.7, 0.7], [0.0, 0.0, 0.0]]
    assert metrics["prm/failures"] == 1.0
    raising = PRMStepRewards(BrokenScorer(fail=True), ProcessRewardConfig(source="prm", prm="unused"))
    with pytest.raises(PRMScoringError, match="the PRM failed on the 2 completions.*device lost"):
        raising(["Q: a", "Q: b"], [SOLUTION, SOLUTION], [1.0, 1.0], [{"steps": []}] * 2)
    counting = PRMStepRewards(BrokenScorer(fail=True), ProcessRewardConfig(source="prm", prm="unused", on_error="zero"))
    rewards, _, metrics = counting(["Q: a", "Q: b"], [SOLUTION, ""], [1.0, 1.0], [{"steps": []}] * 2)
    assert rewards == [[0.0, 0.0, 0.0], []] and metrics["prm/failures"] == 2.0
