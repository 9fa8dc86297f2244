"""The hf engine's sort-free sampler (grpo_mega.rollout.sampling), both methods: the distribution of transformers'
temperature / top-k / top-p warpers (a chi-square test on a small vocabulary, which a sampler off by a temperature
fails), the top-p nucleus of the bisection equal to the sorted one, a row's sample independent of the batch's other
rows, and the inverse-CDF method's samples equal to the sampler's before issue 77 at the same seed."""

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo_mega.rollout.sampling import METHODS, TokenSampler, nucleus_threshold, sample_inverse_cdf

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -1.0, -2.5])
DRAWS = 40_000
P_VALUE = 1e-4  # a correct sampler fails one test in 10,000 runs; the draws are seeded, so a run is repeatable


def warped_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers samples from: its warpers in its order, then softmax."""
    scores = logits[None].clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0].double()


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """P-value of Pearson's chi-square of ``counts`` against the distribution ``expected`` (over its support)."""
    support = expected > 0
    frequency = expected[support] * counts.sum()
    statistic = ((counts[support].double() - frequency) ** 2 / frequency).sum()
    degrees = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.7, 0, 1.0),  # temperature alone
    (1.3, 3, 1.0),  # top-k
    (1.0, 0, 0.8),  # top-p over the whole vocabulary (the bisection)
    (0.9, 5, 0.75),  # top-p over the top-k candidates (a cumulative sum of k values)
])
def test_the_sampler_draws_transformers_warped_distribution(temperature, top_k, top_p, method):
    expected = warped_distribution(LOGITS, temperature, top_k, top_p)
    torch.manual_seed(0)
    sampler = TokenSampler(temperature=temperature, top_k=top_k, top_p=top_p, method=method)
    chosen = sampler.sample(LOGITS.repeat(DRAWS, 1), DRAWS, torch.arange(DRAWS))
    counts = torch.bincount(chosen, minlength=len(LOGITS))
    assert counts[expected == 0].sum() == 0, (counts, expected)  # nothing outside the top-k / nucleus
    assert chi_square_p_value(counts, expected) > P_VALUE, (counts / DRAWS, expected)
    # The test has the power to see a wrong sampler: the same draws against the distribution without temperature
    # (or, at T=1, without the top-p cut) fail it.
    wrong = warped_distribution(LOGITS, 1.0, top_k, top_p) if temperature != 1.0 else warped_distribution(
        LOGITS, 1.0, top_k, 1.0)
    assert chi_square_p_value(counts, wrong) < P_VALUE


def test_the_bisection_nucleus_is_the_sorted_nucleus():
    """transformers' rule (sort, cumulative sum, keep the tokens whose mass above is < top_p) on 300 rows of a
    1,000-token vocabulary with spread-out logits: the same kept set, row for row."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 1000, generator=generator) * torch.linspace(0.5, 4.0, 300)[:, None]
    probs = torch.softmax(logits, dim=-1)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        ours = probs >= nucleus_threshold(probs, top_p)[:, None]
        reference = TopPLogitsWarper(top_p=top_p)(None, logits.clone()) > float("-inf")
        assert torch.equal(ours, reference), (top_p, (ours != reference).sum())


def test_a_rows_sample_does_not_depend_on_the_other_rows_in_the_batch():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 50, generator=generator)
    for sampler in [TokenSampler(method=method, **options) for method in METHODS for options in (
            {}, dict(temperature=0.8, top_k=10, top_p=0.9), dict(top_p=0.7))]:
        torch.manual_seed(5)
        everyone = sampler.sample(logits, 12, torch.arange(12))
        some = torch.tensor([1, 4, 5, 11])
        torch.manual_seed(5)
        assert torch.equal(sampler.sample(logits[some], 12, some), everyone[some])


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 0, 0.9), (1.2, 7, 0.85)])
def test_the_inverse_cdf_method_samples_what_the_sampler_before_it_sampled(temperature, top_k, top_p):
    """The sampler before issue 77: transformers' warpers (a sort for top-p), softmax, one uniform per row, the inverse
    CDF. The CPU's method draws the same uniform and picks the same token, but where a float rounding of the
    unnormalised cumulative sum lands a uniform on the other side of a boundary (none in these 4,000 rows)."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(4000, 60, generator=generator) * 2
    torch.manual_seed(9)
    ours = TokenSampler(temperature=temperature, top_k=top_k, top_p=top_p, method="inverse_cdf").sample(
        logits, 4000, None)
    scores = logits.clone()
    for warper in ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + (
            [TopKLogitsWarper(top_k=top_k)] if top_k else []) + ([TopPLogitsWarper(top_p=top_p)] if top_p < 1 else []):
        scores = warper(None, scores)
    torch.manual_seed(9)
    before = sample_inverse_cdf(torch.softmax(scores, dim=-1), torch.rand(4000))
    assert int((ours != before).sum()) == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        TokenSampler(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        TokenSampler(top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        TokenSampler(top_k=-1)
    with pytest.raises(ValueError, match="method"):
        TokenSampler(method="sort")
