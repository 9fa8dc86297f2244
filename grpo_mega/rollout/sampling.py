"""Token sampling for the hf engine's decode loop without sorting the vocabulary and without a host round trip.

transformers' ``TopPLogitsWarper`` sorts the whole vocabulary of every row at every step (152k ids for Qwen2.5), and
inverse-CDF sampling needs a cumulative sum over it and a host check for the target rounding past the total. Here:

- temperature divides the logits (transformers' ``TemperatureLogitsWarper``);
- top-k takes the k best ids with ``torch.topk`` (k outputs, no sort of the vocabulary); the rest of the step works
  on those k candidates only. transformers keeps ties with the k-th score as well; here exactly k are kept, which
  differs only where two logits are bit-equal at the k-th place;
- top-p keeps a token when the probability mass strictly above it is < ``top_p`` (transformers' rule: the smallest
  set of most likely tokens whose mass reaches ``top_p``). Over top-k candidates (sorted by ``topk``) that is a
  cumulative sum of k values, exact. Without top-k the nucleus is ``{p_i >= tau}`` for the largest ``tau`` with
  ``sum(p_i for p_i >= tau) >= top_p``: ``tau`` is found by bisection over the bit patterns of positive float32
  values (monotone in the value), 30 fixed rounds of a compare and a row sum, so it is exact to the last bit with
  no sort and no data-dependent branch (ties at ``tau`` are all kept, where a sort keeps some of them);
- the token is drawn by an exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` i.i.d. is ``i`` with
  probability ``p_i / sum(p)`` (the Gumbel-max trick in the probability domain; nano-vllm and gpt-fast sample so).

Batch independence (the decode loop's contract): the noise is drawn for EVERY row of the call at every step
(``call_rows``), finished or compacted-away rows included, and the batch's rows take their own call row's noise, so a
row's tokens do not depend on which other rows are still in the batch. The race's samples differ from the inverse-CDF
sampler's at the same seed (other random numbers per token); the distribution is the same
(tests/test_rollout_sampling.py: chi-square against transformers' warpers). Off CUDA the engine keeps the inverse
CDF (``method_for``): one uniform per call row, a cumulative sum over the vocabulary (no sort either), the same
samples as the sampler before issue 77 at a seed, but for ties at the top-k boundary or the nucleus threshold and the
rounding of an unnormalised versus a renormalised cumulative sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_P_BISECTION_ROUNDS = 30
"""Rounds of the top-p threshold bisection: 2**30 > 0x3F800001, one past the bit pattern of 1.0f, so the interval of
bit patterns shrinks to one value."""


@dataclass(frozen=True)
class TokenSampler:
    """Temperature / top-k / top-p sampling of one token per row (``SamplingConfig``'s fields, same meaning)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    method: str = "race"
    """``race`` (the exponential race: rows x vocabulary noise, no scan) or ``inverse_cdf`` (one uniform per row and
    a cumulative sum over the vocabulary: the sampler before issue 77, whose samples it reproduces at a seed; 2-3x
    cheaper than the race's noise on the CPU for vocabularies of 2k-32k ids). :func:`method_for` picks per device."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"TokenSampler.method must be one of {METHODS}, got {self.method!r}")
        if not self.temperature > 0:
            raise ValueError(f"TokenSampler.temperature must be > 0 (greedy is the decode loop's own), "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"TokenSampler.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"TokenSampler.top_p must be in (0, 1], got {self.top_p}")

    def probabilities(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(probabilities after temperature, top-k and top-p, unnormalised where top-p removed mass; the candidate
        ids of each column, or None when the columns are the vocabulary) for ``logits`` [rows, vocab]."""
        scores = logits / self.temperature if self.temperature != 1.0 else logits
        ids = None
        if 0 < self.top_k < scores.shape[-1]:
            scores, ids = torch.topk(scores, self.top_k, dim=-1)  # sorted, most likely first
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            if ids is not None:
                above = probs.cumsum(dim=-1) - probs  # mass of the candidates strictly more likely (sorted)
                probs = probs.masked_fill(above >= self.top_p, 0.0)
            else:
                probs = probs.masked_fill(probs < nucleus_threshold(probs, self.top_p)[:, None], 0.0)
        return probs, ids

    def sample(self, logits: torch.Tensor, call_rows: int, batch_rows: torch.Tensor | None) -> torch.Tensor:
        """[rows] sampled ids for ``logits`` [rows, vocab] (float32), whose rows are the call's rows
        ``batch_rows`` out of ``call_rows`` (None: all of them, in order); noise from the device's default
        generator, none of it read on the host."""
        probs, ids = self.probabilities(logits)
        if self.method == "inverse_cdf":
            uniform = torch.rand(call_rows, device=probs.device)  # one per row of the call
            if batch_rows is not None:
                uniform = uniform.index_select(0, batch_rows)
            if ids is not None:  # back to vocabulary order, as the warpers left it
                probs = torch.zeros_like(logits).scatter_(1, ids, probs)
            return sample_inverse_cdf(probs, uniform)
        noise = torch.empty(call_rows, probs.shape[-1], device=probs.device, dtype=probs.dtype).exponential_()
        if batch_rows is not None:
            noise = noise.index_select(0, batch_rows)
        # An Exp(1) draw of exactly 0 (a uniform of 0 in float32) would make 0 / 0: the smallest normal float
        # keeps p / E finite for p <= 1 and 0 for removed tokens.
        noise = noise.clamp_(min=torch.finfo(probs.dtype).tiny)
        chosen = (probs / noise).argmax(dim=-1)
        return chosen if ids is None else ids.gather(1, chosen[:, None])[:, 0]


METHODS = ("race", "inverse_cdf")


def method_for(device: torch.device) -> str:
    """The sampling method of a device: the race on CUDA (no scan, no sort; noise is cheap there), the inverse CDF
    elsewhere (the CPU's random numbers cost more than its scan; the same samples as before issue 77)."""
    return "race" if torch.device(device).type == "cuda" else "inverse_cdf"


def nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[rows] the largest float32 ``tau`` with ``sum(p for p in row if p >= tau) >= top_p`` for each row of ``probs``
    ([rows, vocab], non-negative float32): the nucleus is ``row >= tau``. Bisection over bit patterns: non-negative
    float32 values order as their int32 bits, so :data:`TOP_P_BISECTION_ROUNDS` rounds pin ``tau`` exactly."""
    if probs.dtype != torch.float32:
        raise TypeError(f"nucleus_threshold needs float32 probabilities, got {probs.dtype}")
    rows = probs.shape[0]
    low = torch.zeros(rows, dtype=torch.int32, device=probs.device)  # mass(0.0) = everything >= top_p
    high = torch.full((rows,), 0x3F800001, dtype=torch.int32, device=probs.device)  # above 1.0: mass 0 < top_p
    zero = probs.new_zeros(())
    for _ in range(TOP_P_BISECTION_ROUNDS):
        middle = (low + high) // 2
        tau = middle.view(torch.float32)
        mass = torch.where(probs >= tau[:, None], probs, zero).sum(dim=-1)
        enough = mass >= top_p
        low = torch.where(enough, middle, low)
        high = torch.where(enough, high, middle)
    return low.view(torch.float32)


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] the token of each row whose CDF first exceeds ``uniform`` ([rows] in [0, 1)) x the row's total
    probability: exact sampling from ``probs`` ([rows, vocab], non-negative), never a zero-probability token. (The
    decode loop's sampler before the exponential race; kept as the reference the chi-square tests compare with.)"""
    cdf = probs.cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # The target rounded up to the total: the token at which the CDF reaches the total (it has probability), found
    # by one search per row rather than a pass over the vocabulary, and with no host check of whether any row did.
    last_possible = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False).squeeze(1)
    return torch.where(chosen >= probs.shape[1], last_possible, chosen)
