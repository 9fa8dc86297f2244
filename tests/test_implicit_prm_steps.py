"""The implicit PRM's step rewards from its token rewards (``grpo_mega.stages.implicit_prm``), without an engine: the
learned PRM's steps and answer guard, step sums or probabilities, then ``process_reward`` shaping as for a PRM."""

import math

import pytest
import torch

from grpo_mega.config import GRPOConfig
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.rollout.base import Completion
from grpo_mega.stages.answer_guard import AnswerGuard
from grpo_mega.stages.implicit_prm import ImplicitPRM, outcome_labels
from grpo_mega.stages.rollout import RolloutBatch

ANSWERED = "Step 1: 2 + 3 = 5\nThe answer is 5. junk"
UNANSWERED = "Step 1: 2 + 3 = 5\nStep 2: 5 * 2 = 9\n"


def _decode(ids):  # one character per token
    return "".join(chr(i) for i in ids)


def _batch(texts, scores):
    records = [PromptRecord(prompt="Q", prompt_ids=[1], answer="5", raw_prompt="Q", source="t", extra={})]
    completions = [Completion(prompt_index=0, prompt_ids=[1], response_ids=[ord(c) for c in text], text=text,
                              response_logprobs=[0.0] * len(text), finish_reason="eos") for text in texts]
    scores = torch.tensor(scores)
    return RolloutBatch(records, completions, scores.clone(), scores)


def _prm(*overrides, guard=True):
    cfg = GRPOConfig()
    cfg.algorithm.num_return_sequences_in_group = 2
    cfg.process_reward.step_pattern = r"\n"
    for key, value in overrides:
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    guard = AnswerGuard(None, cfg.process_reward.missing_answer_score) if guard else None
    return ImplicitPRM(None, None, cfg, decode=_decode, pad_id=0, owns_reference=True, answer_guard=guard)


def _token_rewards(texts):
    """Token t of every response gets reward t + 1, after a one-token prompt (column 0)."""
    width = 1 + max(len(t) for t in texts)
    rewards = torch.zeros(len(texts), width)
    for row, text in enumerate(texts):
        rewards[row, 1 : 1 + len(text)] = torch.arange(1, len(text) + 1, dtype=torch.float32)
    return rewards, torch.ones(len(texts), dtype=torch.long)


def _tri(a, b):  # sum of t + 1 for t in a..b
    return sum(range(a + 1, b + 2))


def test_step_sums_over_the_guarded_steps_with_a_missing_answer_scored_as_configured():
    texts = [ANSWERED, UNANSWERED]
    prm = _prm(("process_reward.missing_answer_score", -3.0))
    rewards, ends = prm._step_rewards(_batch(texts, [1.0, 0.0]), *_token_rewards(texts))
    first_end = ANSWERED.index("\n")
    answer_end = ANSWERED.index(" junk")
    # the answered completion: its step and its answer, cut at the answer's end ("junk" is in no step)
    assert ends[0] == [first_end, answer_end - 1]
    assert rewards[0] == [_tri(0, first_end), _tri(first_end + 1, answer_end - 1)]
    # the unanswered one: its two steps, then the missing answer's step on its last token, which replaces the
    # second step there (one step per token) and is scored missing_answer_score
    second = UNANSWERED.index("\n")
    assert ends[1] == [second, len(UNANSWERED) - 1]
    assert rewards[1] == [_tri(0, second), -3.0]


def test_probabilities_and_the_step_reward_options_apply_as_to_a_prm():
    texts = [ANSWERED, ANSWERED]
    prm = _prm(("implicit_prm.step_value", "probability"), ("process_reward.step_reward", "progress"),
               ("process_reward.outcome_on_last_step", True))
    rewards, _ = prm._step_rewards(_batch(texts, [1.0, 0.0]), *_token_rewards(texts))
    first_end = ANSWERED.index("\n")
    q1, q2 = _tri(0, first_end), _tri(0, ANSWERED.index(" junk") - 1)
    sigmoid = lambda q: 1 / (1 + math.exp(-q))  # noqa: E731
    start = 0.5  # progress: s_0 is the group's mean outcome
    for row, outcome in enumerate([1.0, 0.0]):
        expected = [sigmoid(q1) - start, sigmoid(q2) - sigmoid(q1) + outcome]
        assert rewards[row] == pytest.approx(expected, abs=1e-6)


def test_token_steps_give_every_token_through_the_answer_its_own_reward_and_the_outcome_on_the_last():
    texts = [ANSWERED, UNANSWERED]
    prm = _prm(("implicit_prm.steps", "tokens"), ("process_reward.missing_answer_score", -3.0),
               ("process_reward.outcome_on_last_step", True))
    rewards, ends = prm._step_rewards(_batch(texts, [1.0, 0.0]), *_token_rewards(texts))
    answer_end = ANSWERED.index(" junk")
    # through the answer's last token, each token its own reward (t + 1); the outcome added on the last
    assert ends[0] == list(range(answer_end))
    assert rewards[0] == [float(t + 1) for t in range(answer_end - 1)] + [answer_end + 1.0]
    # no answer: every token but the last, then the missing answer's step on the last token
    assert ends[1] == list(range(len(UNANSWERED)))
    assert rewards[1] == [float(t + 1) for t in range(len(UNANSWERED) - 1)] + [-3.0]
    # the same total as the text's step sums, split finer
    text_rewards, _ = _prm(("process_reward.outcome_on_last_step", True))._step_rewards(
        _batch(texts, [1.0, 0.0]), *_token_rewards(texts))
    assert sum(rewards[0]) == sum(text_rewards[0])


def test_without_the_guard_the_whole_text_is_split_and_summed():
    texts = [ANSWERED]
    prm = _prm(guard=False)
    rewards, ends = prm._step_rewards(_batch(texts, [1.0]), *_token_rewards(texts))
    assert ends[0] == [ANSWERED.index("\n"), len(ANSWERED) - 1]
    assert sum(rewards[0]) == _tri(0, len(ANSWERED) - 1)


def test_labels_must_be_verifier_scores_in_0_1():
    assert torch.equal(outcome_labels(torch.tensor([0.0, 1.0, 0.5])), torch.tensor([0.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match=r"label in \[0, 1\].*\[-1.0, 1.0\]"):
        outcome_labels(torch.tensor([-1.0, 1.0]))
