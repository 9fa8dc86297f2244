"""Issue 60: ``reward.function: verl_default``, verl's default reward by the row's ``data_source`` for its math
sources, on grpo-mega's answer checks; it gives the outcome under process supervision too. And a step whose reward
calls all failed stops the run instead of training on zeros."""

from __future__ import annotations

import pytest
import torch

from grpo_mega.config import AlgorithmConfig, ProcessRewardConfig, RewardConfig
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.reward import RewardError, get_reward_function
from grpo_mega.reward.verl_sources import VERL_MATH_SOURCES
from grpo_mega.rollout.base import Completion, SamplingConfig
from grpo_mega.stages import RolloutStage
from grpo_mega.stages.process_reward import PRMStepRewards

verl_default = get_reward_function("verl_default")


def score(source, completion, answer):
    return verl_default("Q", completion, answer, data_source=source, extra_info={})


def test_gsm8k_needs_the_hash_answer():
    assert score("openai/gsm8k", "6 * 12 = 72\n#### 72", "72") == 1.0
    assert score("openai/gsm8k", "#### 1,000", "1000") == 1.0
    assert score("openai/gsm8k", "#### 71", "72") == 0.0
    assert score("openai/gsm8k", "The answer is 72.", "72") == 0.0  # verl's strict form: no ####, no reward


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
def test_math_takes_the_last_boxed_answer(source):
    assert score(source, "so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}") == 1.0
    assert score(source, "so $\\boxed{0.5}$", "\\frac{1}{2}") == 1.0  # equal values, written differently
    assert score(source, "so $\\boxed{3}$", "\\frac{1}{2}") == 0.0
    assert score(source, "the answer is 1/2", "\\frac{1}{2}") == 0.0


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025"])
def test_dapo_takes_the_answer_line_and_gives_minus_one_when_wrong(source):
    assert score(source, "work...\nAnswer: 34", "34") == 1.0
    assert score(source, "work...\nanswer: $34$.", "34") == 1.0
    assert score(source, "work...\nAnswer: 35", "34") == -1.0
    assert score(source, "work... 34", "34") == -1.0


def test_numina_sources_take_boxed_or_the_last_number():
    for source in [name for name in VERL_MATH_SOURCES if name.startswith("numina")]:
        assert score(source, "so \\boxed{12}", "12") == 1.0 and score(source, "so 13", "12") == 0.0


def test_an_unknown_or_missing_data_source_is_named():
    with pytest.raises(ValueError, match="no verifier for data_source 'codecontests'.*your own verl compute_score"):
        score("codecontests", "x", "1")
    with pytest.raises(ValueError, match="has none \\(its columns: \\['extra_info'\\]\\)"):
        verl_default("Q", "x", "1", extra_info={})


def test_the_gold_falls_back_to_verls_reward_model_ground_truth():
    assert verl_default("Q", "#### 5", None, data_source="openai/gsm8k",
                        reward_model={"style": "rule", "ground_truth": "5"}) == 1.0


G = 2


class TextScorer:
    """A PRM stand-in: every step scores 0.5."""

    def score_steps(self, prompts, steps):
        return [[0.5] * len(row) for row in steps]


def _records_and_completions(texts, source="openai/gsm8k", answer="36"):
    record = PromptRecord("Q: 3 * 12?", [1], answer, "3 * 12?", "train.jsonl:1", {"data_source": source})
    completions = [Completion(0, [1], [ord(c) for c in text], [-0.5] * len(text), text, "eos") for text in texts]
    return [record], completions


def _stage(function, **kwargs):
    return RolloutStage(None, None, SamplingConfig(n=G), RewardConfig(function=function),
                        AlgorithmConfig(num_return_sequences_in_group=G, rollout_batch_size=1, dynamic_sampling=False),
                        seed=0, decode=lambda ids: "".join(chr(i) for i in ids), **kwargs)


def test_verl_default_is_the_outcome_a_prm_adds_on_the_last_step():
    settings = ProcessRewardConfig(source="prm", prm="unused", outcome_on_last_step=True, step_pattern="\n\n")
    stage = _stage("verl_default", step_reward_source=PRMStepRewards(TextScorer(), settings))
    records, completions = _records_and_completions(["3 * 12 = 36\n\n#### 36", "3 * 12 = 35\n\n#### 35"])
    batch, failures = stage.score(records, completions)
    assert failures == 0 and batch.scores.tolist() == [1.0, 0.0]
    assert [rewards[-1] for rewards in batch.step_rewards] == [1.5, 0.5]  # PRM 0.5, plus the outcome on the last
    assert [rewards[:-1] for rewards in batch.step_rewards] == [[0.5], [0.5]]


def _run_one_step(stage, records, completions):
    stage.prompts = iter([records])
    stage.generate = lambda records, seed: completions
    return stage.run(step=4)


def test_a_step_whose_reward_calls_all_failed_stops_naming_why():
    def needs_a_column(prompt, completion, answer, **extra):
        return float(extra["solution"] == completion)

    stage = _stage("math_verify")
    stage.reward_fn = needs_a_column
    records, completions = _records_and_completions(["#### 36", "#### 35"])
    with pytest.raises(RewardError, match=r"failed on all 2 completions of step 4 .*the first: .*KeyError\('solution'\)"):
        _run_one_step(stage, records, completions)


def test_a_step_with_one_reward_left_trains_and_counts_the_failures():
    def flaky(prompt, completion, answer, **extra):
        if completion.endswith("35"):
            raise TimeoutError("verifier timed out")
        return 1.0

    stage = _stage("math_verify")
    stage.reward_fn = flaky
    records, completions = _records_and_completions(["#### 36", "#### 35"])
    batch, metrics = _run_one_step(stage, records, completions)
    assert metrics["reward/failures"] == 1.0 and torch.equal(batch.scores, torch.tensor([1.0, 0.0]))
