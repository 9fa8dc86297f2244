"""Map a step's end in the completion text (a character offset) to the index of its last response token, and keep
one step per token."""

from __future__ import annotations

from typing import Callable, Sequence


def step_end_tokens(decode: Callable[[list[int]], str], response_ids: Sequence[int], char_ends: Sequence[int]) -> list[int]:
    """For each character offset ``e`` (exclusive end of a step in ``decode(response_ids)``), the index of the
    first response token whose decoded prefix reaches ``e``: the token that completes the step.

    Decoding is monotone in the prefix for the tokenizers in use (byte-level BPE, sentencepiece), so a binary
    search needs O(log T) prefix decodes per step. An offset beyond the decoded text maps to the last token.
    """
    ids = list(response_ids)
    ends, low = [], 0
    for target in char_ends:
        high = len(ids) - 1
        lo = low
        while lo < high:
            mid = (lo + high) // 2
            if len(decode(ids[: mid + 1])) >= target:
                high = mid
            else:
                lo = mid + 1
        ends.append(lo)
        low = lo
    return ends


def one_step_per_token(rewards: Sequence[float], token_ends: Sequence[int]) -> tuple[list[float], list[int]]:
    """Step rewards on their end tokens, one step per token: when two steps end in one token (a short step inside a
    long token, or the answer guard's missing-answer step on the last token of a completion cut at the length cap),
    the later step's reward counts."""
    kept_rewards: list[float] = []
    kept_ends: list[int] = []
    for reward, end in zip(rewards, token_ends):
        if kept_ends and kept_ends[-1] == end:
            kept_rewards[-1] = reward
        else:
            kept_rewards.append(reward)
            kept_ends.append(end)
    return kept_rewards, kept_ends
