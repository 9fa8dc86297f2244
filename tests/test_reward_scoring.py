"""Rewards scored once per completion and shared by every rank; failures per ``reward.on_error``; per-step
rewards (``StepRewards``) validated; the synthetic task's ground-truth step reward."""

import math

import pytest

from dist_utils import run_distributed
from grpo_mega.data.synthetic import generate_problems
from grpo_mega.reward import RewardError, StepRewards, score_samples
from grpo_mega.reward.synthetic import synthetic_step_reward


def rank_dependent_flaky_reward(prompt, completion, answer):
    """A verifier whose result depends on the rank that calls it, and that raises on some samples on rank 1
    only: the situation in which ranks that each score every completion build different batches."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1 and completion.endswith("3"):
        raise TimeoutError("verifier timed out")
    return float(len(completion)) + 100.0 * rank


ON_ERROR = ("zero", "raise")


def _score_on_every_rank():
    """Each ``on_error`` mode of ON_ERROR in turn, in one job (a spawn costs seconds of imports per process): the
    scores (or the error) of each, by mode."""
    import torch.distributed as dist

    from grpo_mega.parallel import destroy_distributed, init_distributed
    from grpo_mega.reward import score_across_ranks

    init_distributed(1, 1, seed=0, device="cpu")
    completions = [f"c{'x' * i}{i}" for i in range(7)]
    outcomes = {}
    for on_error in ON_ERROR:
        try:
            results = score_across_ranks(rank_dependent_flaky_reward, ["p"] * 7, completions, ["a"] * 7,
                                         on_error=on_error)
            outcomes[on_error] = [(r.score, r.failed) for r in results]
        except RewardError as error:
            outcomes[on_error] = f"RewardError: {error}"
        dist.barrier()
    destroy_distributed()
    return outcomes


@pytest.fixture(scope="module")
def by_mode():
    """Every rank's outcome, by ``on_error`` mode."""
    per_rank = run_distributed(_score_on_every_rank, 2)
    return {mode: [rank[mode] for rank in per_rank] for mode in ON_ERROR}


def test_every_rank_gets_the_same_rewards_each_scored_once(by_mode):
    per_rank = by_mode["zero"]
    assert per_rank[0] == per_rank[1]
    # sample i is scored by rank i % 2 only (rank 1 adds 100); sample 3 raised on rank 1 and scores 0
    expected = [(float(len(f"c{'x' * i}{i}")) + 100.0 * (i % 2), False) for i in range(7)]
    expected[3] = (0.0, True)
    assert per_rank[0] == expected


def test_on_error_raise_stops_every_rank_with_the_same_error(by_mode):
    per_rank = by_mode["raise"]
    assert per_rank[0] == per_rank[1]
    assert per_rank[0].startswith("RewardError") and "sample 3" in per_rank[0] and "timed out" in per_rank[0]


def test_on_error_zero_counts_non_numbers_and_nan():
    values = iter([1.0, math.nan, "yes", 0.5])
    results = score_samples(lambda p, c, a: next(values), ["p"] * 4, ["c"] * 4, ["a"] * 4, on_error="zero")
    assert [(r.score, r.failed) for r in results] == [(1.0, False), (0.0, True), (0.0, True), (0.5, False)]
    assert "sample 1" in results[1].error


@pytest.mark.parametrize("bad, reason", [
    (StepRewards(1.0, [1.0, 0.0], [3]), "as many step ends"),
    (StepRewards(1.0, [1.0, 0.0], [4, 3]), "strictly increasing"),
    (StepRewards(1.0, [1.0], [99]), "strictly increasing"),
    (StepRewards(math.inf, [1.0], [3]), "finite score"),
])
def test_malformed_step_rewards_are_refused_naming_the_problem(bad, reason):
    with pytest.raises(RewardError, match=reason):
        score_samples(lambda p, c, a: bad, ["p"], ["abcdef"], ["a"], on_error="raise")


def test_step_rewards_pass_through_validated():
    good = StepRewards(1.0, [0.25, 1.0], [2, 6])
    (result,) = score_samples(lambda p, c, a: good, ["p"], ["abcdef"], ["a"])
    assert (result.score, result.step_rewards, result.step_ends) == (1.0, [0.25, 1.0], [2, 6])


def test_synthetic_step_reward_marks_the_wrong_step_and_rewards_the_answer_sentence():
    problem = generate_problems(1, seed=0)[0]
    row = problem.to_record()
    right = synthetic_step_reward(problem.prompt, problem.solution, row["answer"], steps=row["steps"])
    assert right.score == 1.0 and right.step_rewards == [1.0] * (len(problem.steps) + 1)
    assert right.step_ends[-1] == len(problem.solution)
    wrong_first = problem.solution.replace(f"= {problem.steps[0].result}.", f"= {problem.steps[0].result + 1}.", 1)
    wrong = synthetic_step_reward(problem.prompt, wrong_first, row["answer"], steps=row["steps"])
    assert wrong.step_rewards == [0.0] + [1.0] * len(problem.steps)  # only the miscalculated step is wrong
    no_steps = synthetic_step_reward(problem.prompt, " hmm", row["answer"], steps=row["steps"])
    assert (no_steps.score, no_steps.step_rewards, no_steps.step_ends) == (0.0, [0.0], [4])
