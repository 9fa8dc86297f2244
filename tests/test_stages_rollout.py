"""The rollout stage's scoring and filtering, and the batch builder: rewards per completion and per step, the
dynamic-sampling filter (DAPO), and the row layout the advantages and the engine rely on (groups contiguous,
prompt i's G completions at rows i*G .. i*G+G-1)."""

import pytest
import torch

from grpo_mega.config import AlgorithmConfig, RewardConfig
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.reward import StepRewards
from grpo_mega.rollout.base import Completion, SamplingConfig
from grpo_mega.stages import RolloutBatch, RolloutStage, build_training_batch
from grpo_mega.stages.rollout import keep_informative_groups, zero_signal_group_fraction
from grpo_mega.stages.step_tokens import step_end_tokens

G = 4


def exact_match(prompt, completion, answer):
    return float(completion.strip() == answer)


def char_decode(ids):
    """Token id k decodes to chr(k): one character per token."""
    return "".join(chr(i) for i in ids)


def make_groups(answers_and_texts):
    """One prompt per (answer, [G texts]); completion ids encode the text one character per token."""
    records, completions = [], []
    for p, (answer, texts) in enumerate(answers_and_texts):
        records.append(PromptRecord(f"Q{p}", [1, p], answer, f"Q{p}", f"f.jsonl:{p + 1}"))
        for text in texts:
            ids = [ord(ch) for ch in text]
            completions.append(Completion(p, [1, p], ids, [-0.5] * len(ids), text, "eos"))
    return records, completions


def stage(reward_fn, **algorithm):
    reward = RewardConfig(function="synthetic")
    rollout = RolloutStage(None, None, SamplingConfig(n=G), reward, AlgorithmConfig(num_return_sequences_in_group=G,
                           **algorithm), seed=0, decode=char_decode)
    rollout.reward_fn = reward_fn
    return rollout


def test_equal_reward_groups_are_dropped_and_the_rest_keep_their_rows():
    records, completions = make_groups([
        ("1", ["1", "2", "1", "3"]),  # mixed: kept
        ("2", ["0", "0", "0", "0"]),  # all wrong: dropped
        ("3", ["3", "3", "3", "3"]),  # all right: dropped
        ("4", ["5", "4", "5", "5"]),  # mixed: kept
    ])
    scored, failures = stage(exact_match).score(records, completions)
    assert failures == 0
    assert scored.rewards.tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0]
    kept = keep_informative_groups(scored, G)
    assert [r.answer for r in kept.records] == ["1", "4"]
    assert [c.text for c in kept.completions] == ["1", "2", "1", "3", "5", "4", "5", "5"]
    assert kept.rewards.tolist() == [1, 0, 1, 0, 0, 1, 0, 0]
    assert torch.equal(kept.scores, kept.rewards)
    # refilling appends the next round's groups after the kept ones; first_groups trims whole groups
    both = RolloutBatch.concat(kept, kept)
    assert len(both) == 4 and both.rewards.shape == (16,)
    three = both.first_groups(3)
    assert len(three) == 3 and len(three.completions) == 12 and three.rewards.shape == (12,)


def test_all_groups_equal_leaves_nothing_to_train_on():
    records, completions = make_groups([("1", ["1"] * G), ("2", ["9"] * G)])
    scored, _ = stage(exact_match).score(records, completions)
    kept = keep_informative_groups(scored, G)
    assert len(kept) == 0 and kept.rewards.numel() == 0 and kept.completions == []


def test_zero_signal_groups_are_those_whose_g_scores_are_all_equal():
    scores = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25], dtype=torch.float32)
    assert zero_signal_group_fraction(scores, G) == 0.5  # groups 2 (all wrong) and 3 (all right)
    assert zero_signal_group_fraction(scores[4:12], G) == 1.0 and zero_signal_group_fraction(scores[:4], G) == 0.0


def test_a_failing_reward_call_scores_zero_and_is_counted():
    def flaky(prompt, completion, answer):
        if completion == "boom":
            raise TimeoutError("verifier timed out")
        return 1.0

    records, completions = make_groups([("1", ["a", "boom", "b", "boom"])])
    scored, failures = stage(flaky).score(records, completions)
    assert failures == 2 and scored.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_batch_rows_carry_group_advantages_on_response_tokens_only():
    records, completions = make_groups([("1", ["1a", "2a", "2a", "2a"])])
    scored, _ = stage(lambda p, c, a: float(c[0] == a)).score(records, completions)
    batch = build_training_batch(scored, AlgorithmConfig(num_return_sequences_in_group=G), pad_id=0)
    assert torch.equal(batch["advantages"][:, :2], torch.zeros(G, 2))  # prompt tokens
    # one right of four: (1 - 0.25) / std([1, 0, 0, 0]) = 0.75 / 0.5, the others -0.25 / 0.5
    expected = torch.tensor([[1.5, 1.5], [-0.5, -0.5], [-0.5, -0.5], [-0.5, -0.5]])
    torch.testing.assert_close(batch["advantages"][:, 2:], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["rollout_logprobs"][:, 2:], torch.full((G, 2), -0.5))


def test_step_ends_map_characters_to_the_token_that_completes_the_step():
    # tokens: "ab", "c", "de", "f" -> text "abcdef"; steps end after "abc" (3) and "abcdef" (6)
    pieces = ["ab", "c", "de", "f"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert step_end_tokens(decode, [0, 1, 2, 3], [3, 6]) == [1, 3]
    assert step_end_tokens(decode, [0, 1, 2, 3], [1, 4]) == [0, 2]  # mid-token ends belong to that token


def step_reward(prompt, completion, answer):
    """Steps are the '.'-terminated pieces; a step is right when it is 'x.'; the score is the last step's."""
    ends = [i + 1 for i, ch in enumerate(completion) if ch == "."]
    rewards = [1.0 if completion[max(0, e - 2):e] == "x." else 0.0 for e in ends]
    return StepRewards(score=rewards[-1] if rewards else 0.0, step_rewards=rewards, step_ends=ends)


def test_process_supervision_gives_each_token_the_sum_of_its_own_and_later_steps():
    # two steps per completion: tokens 0-1 are step 1, tokens 2-3 step 2
    records, completions = make_groups([("", ["x.x.", "x.y.", "y.x.", "y.y."])])
    scored, _ = stage(step_reward).score(records, completions)
    assert scored.step_ends == [[1, 3]] * 4
    assert scored.step_rewards == [[1, 1], [1, 0], [0, 1], [0, 0]]
    batch = build_training_batch(scored, AlgorithmConfig(num_return_sequences_in_group=G, supervision="process"), 0)
    # pooled step rewards {1,1,1,0,0,1,0,0}: mean 0.5, std sqrt(2/7); n = +-0.5 / std
    n = 0.5 / (2 / 7) ** 0.5
    per_step = torch.tensor([[n, n], [n, -n], [-n, n], [-n, -n]])
    expected = torch.stack([per_step[:, 0] + per_step[:, 1]] * 2 + [per_step[:, 1]] * 2, dim=1)
    torch.testing.assert_close(batch["advantages"][:, 2:], expected, atol=1e-4, rtol=0)


def test_process_supervision_without_step_rewards_is_refused_naming_the_fix():
    records, completions = make_groups([("1", ["1", "2", "1", "3"])])
    scored, _ = stage(exact_match).score(records, completions)
    with pytest.raises(ValueError, match="returns StepRewards"):
        build_training_batch(scored, AlgorithmConfig(num_return_sequences_in_group=G, supervision="process"), 0)


def test_two_steps_ending_in_one_token_keep_the_later_reward():
    records, completions = make_groups([("", ["ab", "ab", "ab", "ab"])])

    def reward(prompt, completion, answer):  # char_decode is one char per token, so make one token hold both ends
        return StepRewards(score=0.0, step_rewards=[0.2, 0.7], step_ends=[1, 2])

    rollout = stage(reward)
    rollout.decode = lambda ids: "ab"[: 2 * len(ids)]  # the first token decodes to both characters
    scored, _ = rollout.score(records, completions)
    assert scored.step_ends == [[0]] * 4 and scored.step_rewards == [[0.7]] * 4


def _advantages(rewards, **algorithm):
    records, completions = make_groups([("", ["ab"] * G), ("", ["ab"] * G)])
    batch = RolloutBatch(records, completions, torch.tensor(rewards), torch.tensor(rewards))
    built = build_training_batch(batch, AlgorithmConfig(num_return_sequences_in_group=G, **algorithm), pad_id=0)
    return built["advantages"][:, 2]  # first response token; every response token of a row carries the same value


def test_reward_clip_bounds_rewards_before_the_group_normalisation():
    rewards = [2.0, 0.4, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    clipped = _advantages(rewards, reward_clip=0.5)
    expected = _advantages([0.5, 0.4, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(clipped, expected)
    assert not torch.allclose(clipped, _advantages(rewards))


def test_whitening_gives_zero_mean_unit_std_over_completions():
    whitened = _advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], whiten_advantages=True)
    assert abs(float(whitened.mean())) < 1e-5 and abs(float(whitened.std()) - 1) < 1e-3


def test_advantage_clip_bounds_the_advantages():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert _advantages(rewards).max() == pytest.approx(1.5, abs=1e-4)  # 0.75 / 0.5 before clipping
    clipped = _advantages(rewards, advantage_clip=1.0)
    assert float(clipped.max()) == pytest.approx(1.0) and float(clipped.min()) >= -1.0


def test_dynamic_sampling_under_process_supervision_keeps_groups_whose_steps_differ():
    # group 0: every outcome equal but steps differ (informative for process advantages); group 1: all steps equal
    records, completions = make_groups([("", ["x.y.", "y.y.", "y.y.", "y.y."]), ("", ["x.x."] * G)])
    scored, _ = stage(step_reward).score(records, completions)
    assert scored.rewards.reshape(2, G).std(dim=1).tolist() == [0.0, 0.0]
    assert len(keep_informative_groups(scored, G)) == 0
    kept = keep_informative_groups(scored, G, by_steps=True)
    assert len(kept) == 1 and [c.text for c in kept.completions] == ["x.y.", "y.y.", "y.y.", "y.y."]


def is_right(prompt, completion, answer):
    return float(completion.strip() == answer)


def is_short(completions, **kwargs):  # TRL's signature; None (not applicable) for an empty completion
    return [None if not c else float(len(c) < 3) for c in completions]


def test_several_reward_functions_log_each_ones_mean_as_trl_does():
    """Issue 79 item 7: reward.functions logged only the weighted sum; each function's own mean (before its weight,
    over the samples it applied to) is `reward/<func>/mean`, TRL's `rewards/<func>/mean`."""
    from grpo_mega.reward.registry import build_reward_function
    from grpo_mega.stages.rollout import _merge_rounds

    fn = build_reward_function("synthetic", [f"{__name__}:is_right", f"{__name__}:is_short"], [1.0, 0.5])
    records, completions = make_groups([("1", ["1", "xyz1", "", "2"])])
    rollout = stage(fn)
    scored, failures = rollout.score(records, completions)
    assert failures == 0 and scored.rewards.tolist() == [1.5, 0.0, 0.0, 0.5]
    metrics = _merge_rounds(rollout._step_metrics)
    assert metrics["reward/is_right/mean"] == 0.25
    assert metrics["reward/is_short/mean"] == pytest.approx(2 / 3)  # the empty completion: not applicable
    single = stage(exact_match)
    single.score(records, completions)
    assert not [key for key in _merge_rounds(single._step_metrics) if key.startswith("reward/")]
