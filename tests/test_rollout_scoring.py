"""From completions to the GRPO batch: rewards per completion, the dynamic-sampling filter (DAPO) and the row
layout the advantages and the engine rely on (groups contiguous, prompt i's G completions at rows i*G .. i*G+G-1)."""

import pytest
import torch

from grpo_mega.config import AlgorithmConfig
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.rollout.base import Completion
from grpo_mega.rollout_scoring import (
    compute_advantages,
    concat_groups,
    keep_informative_groups,
    score_groups,
    take_groups,
    training_batch,
)

G = 4


def exact_match(prompt, completion, answer):
    return float(completion.strip() == answer)


def make_groups(answers_and_texts):
    """One prompt per (answer, [G texts]); completion ids encode (prompt, member) so rows can be traced."""
    records, completions = [], []
    for p, (answer, texts) in enumerate(answers_and_texts):
        records.append(PromptRecord(f"Q{p}", [1, p], answer, f"Q{p}", f"f.jsonl:{p + 1}"))
        for m, text in enumerate(texts):
            completions.append(Completion(p, [1, p], [10 * p + m, 2], [-0.5, -0.1], text, "eos"))
    return records, completions


def test_equal_reward_groups_are_dropped_and_the_rest_keep_their_rows():
    records, completions = make_groups([
        ("1", ["1", "2", "1", "3"]),  # mixed: kept
        ("2", ["0", "0", "0", "0"]),  # all wrong: dropped
        ("3", ["3", "3", "3", "3"]),  # all right: dropped
        ("4", ["5", "4", "5", "5"]),  # mixed: kept
    ])
    scored = score_groups(records, completions, exact_match, group_size=G, algorithm=AlgorithmConfig())
    assert scored.rewards.tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0]
    kept = keep_informative_groups(scored, G)
    assert [r.answer for r in kept.records] == ["1", "4"]
    assert [c.response_ids[0] for c in kept.completions] == [0, 1, 2, 3, 30, 31, 32, 33]
    assert kept.rewards.tolist() == [1, 0, 1, 0, 0, 1, 0, 0]
    assert torch.equal(kept.scores, kept.rewards)
    # refilling appends the next round's groups after the kept ones; take_groups trims whole groups
    both = concat_groups(kept, kept)
    assert len(both) == 4 and both.rewards.shape == (16,)
    three = take_groups(both, 3, G)
    assert len(three) == 3 and len(three.completions) == 12 and three.rewards.shape == (12,)


def test_all_groups_equal_leaves_nothing_to_train_on():
    records, completions = make_groups([("1", ["1"] * G), ("2", ["9"] * G)])
    scored = score_groups(records, completions, exact_match, group_size=G, algorithm=AlgorithmConfig())
    kept = keep_informative_groups(scored, G)
    assert len(kept) == 0 and kept.rewards.numel() == 0 and kept.completions == []


def test_batch_rows_carry_group_advantages_on_response_tokens_only():
    records, completions = make_groups([("1", ["1", "2", "2", "2"])])
    scored = score_groups(records, completions, exact_match, group_size=G, algorithm=AlgorithmConfig())
    advantages = compute_advantages(scored.rewards, G, AlgorithmConfig())
    # one right of four: (1 - 0.25) / std([1, 0, 0, 0]) = 0.75 / 0.5, the others -0.25 / 0.5
    assert advantages.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    batch = training_batch(scored, advantages, pad_id=0)
    assert torch.equal(batch["advantages"][:, :2], torch.zeros(G, 2))  # prompt tokens
    expected = torch.tensor([[1.5, 1.5], [-0.5, -0.5], [-0.5, -0.5], [-0.5, -0.5]])
    torch.testing.assert_close(batch["advantages"][:, 2:], expected, atol=1e-5, rtol=0)
