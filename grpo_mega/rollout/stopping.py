"""Where a generated response ends: EOS tokens, stop strings, the length limit.

Stop strings are matched on the decoded text (``skip_special_tokens=True``), the same text a completion returns,
both while generating (the hf engine's decode loop ends a row once its text contains one) and afterwards
(:func:`cut_response`, which finds the token that completed the stop string). transformers' own
``StopStringCriteria`` matches on token strings instead, which can disagree with the decoded text (special tokens,
byte-level pieces); one rule for both places keeps the cut exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from grpo_mega.rollout.base import FinishReason

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class ResponseCut:
    """How many generated tokens a completion keeps, and why it ended there."""

    length: int
    finish_reason: FinishReason


def _stop_string_end(token_ids: Sequence[int], stop: Sequence[str], decode: Decode) -> int | None:
    """Fewest leading tokens whose text contains a stop string, or None when no stop string occurs.

    Binary search: containment only grows as tokens are appended, so O(log L) decodes instead of L.
    """
    if not stop or not token_ids or not any(s in decode(token_ids) for s in stop):
        return None
    low, high = 1, len(token_ids)  # the answer lies in [low, high]; high always contains a stop string
    while low < high:
        middle = (low + high) // 2
        if any(s in decode(token_ids[:middle]) for s in stop):
            high = middle
        else:
            low = middle + 1
    return high


def cut_response(
    token_ids: Sequence[int],
    *,
    eos_token_ids: Collection[int],
    stop: Sequence[str],
    decode: Decode,
    max_new_tokens: int,
) -> ResponseCut:
    """Where a generated row ends.

    The first of: the token completing the first stop string ("stop"; matched on the text before any EOS), the
    first EOS token, kept in the response ("eos"), or ``max_new_tokens`` tokens ("length"). Tokens after the
    end (padding of a finished row in a batch) are dropped.

    Raises RuntimeError when a row has neither an end nor ``max_new_tokens`` tokens: generation stopped it for a
    reason this function does not know, and silently keeping its padding would corrupt training data.
    """
    eos_at = next((i for i, token in enumerate(token_ids) if token in eos_token_ids), None)
    before_eos = token_ids if eos_at is None else token_ids[:eos_at]
    stop_end = _stop_string_end(before_eos, stop, decode)
    if stop_end is not None:
        return ResponseCut(stop_end, "stop")
    if eos_at is not None:
        return ResponseCut(eos_at + 1, "eos")
    if len(token_ids) < max_new_tokens:
        raise RuntimeError(
            f"a generated row ended after {len(token_ids)} tokens without EOS or stop string, before "
            f"max_new_tokens={max_new_tokens}"
        )
    return ResponseCut(max_new_tokens, "length")
