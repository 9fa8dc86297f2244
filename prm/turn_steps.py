"""Turns as steps: where each step of a multi-turn (tool) completion ends, and the text a PRM reads for it. One
convention for everything that splits a tool rollout into steps: ``grpo-mega prm label --steps turns`` (the rows it
writes), ``prm train`` / ``score`` / ``eval`` on those rows, and the trainer's PRM call on turns
(``process_reward.steps: turns``).

- Step k of a multi-turn completion is its k-th assistant turn (``Completion.turns[k]``, a
  ``grpo_mega.rollout.base.TurnRecord``); a turn without a policy token is no step.
- The step ends at the turn's LAST MODEL TOKEN: response index ``turns[k].end - 1`` (the step's credit and its PRM
  score sit there).
- The PRM's input for step k is the prompt plus the whole response through that token, earlier tool turns included;
  the tool turn that answers step k is not in its context. So step k's text (what ``prm.rendering`` writes before
  its tag) is the response tokens after step k-1's end through step k's end, decoded (``decode_response``): the
  tool turn that answered turn k-1 opens step k's text, and the text of steps 1..k is the decoded response through
  step k's end. Tokens after the last step's end (a tool turn the rollout ended on) are in no step.
- A completion with no turns (a single-turn completion) is one step ending at its last response token; a multi-turn
  completion whose first turn made no call has one turn, so one step, the same.

A stored (stepwise) row of turn steps carries, beside its text steps (``completions``), the field
``TURN_STEPS_FIELD``: ``{"response_ids": [...], "step_ends": [...]}``, from which the same step ends (and, with the
policy's tokenizer, the same step texts) come back: ``TurnSteps.from_row`` checks it and names what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from grpo_mega.rollout.base import Completion, TurnRecord

TURN_STEPS_FIELD = "turn_steps"
"""The stepwise row's field holding a turn-split solution's tokens and step ends (``TurnSteps.to_row``)."""


def check_step_ends(step_ends: Sequence[int], response_length: int) -> None:
    """ValueError unless ``step_ends`` are at least one strictly increasing response index in
    ``[0, response_length)``; the message says which end is wrong and why."""
    if not step_ends:
        raise ValueError("no step ends (a solution is at least one step)")
    previous = -1
    for k, end in enumerate(step_ends):
        if isinstance(end, bool) or not isinstance(end, int):
            raise ValueError(f"step end {k} is {end!r}, not a token index")
        if end < 0:
            raise ValueError(f"step end {k} is token {end}, before the response")
        if end >= response_length:
            raise ValueError(f"step end {k} is token {end}, past the response's {response_length} tokens")
        if end <= previous:
            raise ValueError(f"step end {k} (token {end}) is not after step end {k - 1} (token {previous})")
        previous = end


def step_ends_of_turns(turns: Sequence[TurnRecord] | None, response_length: int) -> list[int]:
    """The response index of each step's last model token (the module docstring): ``turn.end - 1`` of every turn
    with a policy token; ``[response_length - 1]`` for a completion without turns. ValueError for a completion
    with no response token or turns that do not lie in order within the response."""
    if response_length < 1:
        raise ValueError("a completion without a response token has no step")
    if not turns:
        return [response_length - 1]
    ends = [turn.end - 1 for turn in turns if turn.end > turn.start]
    if not ends:
        return [response_length - 1]
    check_step_ends(ends, response_length)
    return ends


def step_spans(step_ends: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` response spans of the steps' texts: step k from one past step k-1's end through its own."""
    starts = [0] + [end + 1 for end in step_ends[:-1]]
    return [(start, end + 1) for start, end in zip(starts, step_ends)]


@dataclass(frozen=True)
class TurnSteps:
    """A turn-split response: its token ids and the response index of each step's last model token."""

    response_ids: list[int]
    step_ends: list[int]

    def __post_init__(self) -> None:
        check_step_ends(self.step_ends, len(self.response_ids))

    @classmethod
    def of(cls, completion: Completion) -> TurnSteps:
        """The turn steps of a rollout's completion (its ``turns``; one step without them)."""
        ids = list(completion.response_ids)
        return cls(ids, step_ends_of_turns(completion.turns, len(ids)))

    def texts(self, tokenizer: Any) -> list[str]:
        """Each step's text: its span of the response (``step_spans``) decoded as a completion's text is."""
        from grpo_mega.rollout.base import decode_response

        return [decode_response(tokenizer, self.response_ids[start:stop]) for start, stop in step_spans(self.step_ends)]

    def to_row(self) -> dict:
        """The value of ``TURN_STEPS_FIELD`` in a stored row."""
        return {"response_ids": list(self.response_ids), "step_ends": list(self.step_ends)}

    @classmethod
    def from_row(cls, value: Any, num_steps: int) -> TurnSteps:
        """The turn steps stored in a row's ``TURN_STEPS_FIELD`` for a solution of ``num_steps`` text steps;
        ValueError naming the field and what is wrong (the reader adds the file and line)."""
        where = f"field {TURN_STEPS_FIELD!r}"
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object with 'response_ids' and 'step_ends', got {value!r:.80}")
        ids, ends = value.get("response_ids"), value.get("step_ends")
        for name, values in (("response_ids", ids), ("step_ends", ends)):
            if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in values):
                raise ValueError(f"{where}.{name} must be a list of integers, got {values!r:.80}")
        if len(ends) != num_steps:
            raise ValueError(f"{where} has {len(ends)} step ends for {num_steps} steps ('completions')")
        try:
            check_step_ends(ends, len(ids))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        return cls(list(ids), list(ends))
