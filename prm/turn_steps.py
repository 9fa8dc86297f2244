"""Turns as steps: where each step of a multi-turn (tool) completion begins and ends, and its text. One
convention for everything that splits a tool rollout into steps: ``grpo-mega prm label --steps turns`` (the rows it
writes), ``prm train`` / ``score`` / ``eval`` on those rows, and the trainer's PRM call on turns
(``process_reward.steps: turns``).

- Step k of a multi-turn completion is its k-th assistant turn with a policy (model) token (``Completion.turns``,
  ``grpo_mega.rollout.base.TurnRecord``s; :func:`model_turns`): a turn without one is no step, since no token of
  it could carry the step's credit.
- The step ends at the turn's LAST MODEL TOKEN: response index ``turns[k].end - 1`` (the step's credit and its PRM
  score sit there).
- The PRM's input for step k is the prompt plus the whole response through that token, earlier tool turns included;
  the tool turn that answers step k is not in its context. A PRM reads it from the policy's token ids
  (``prm.turn_rendering``: ``StepScorer.score_turn_steps`` for a rollout, ``score_examples`` for a stored row). Step
  k's text (what a stored row keeps in ``completions``, for people and text tools) is the response tokens after
  step k-1's end through step k's end, decoded (``decode_response``): the tool turn that answered turn k-1 opens it,
  and the texts of steps 1..k are the decoded response through step k's end. Tokens after the last step's end (a
  tool turn the rollout ended on) are in no step.
- A multi-turn completion whose first turn made no call has one turn, so one step. A completion with no turn that
  has a model token (no turn records: not a turn-loop rollout; or only empty turns) has no step: the trainer gives
  it no step reward and ``TurnSteps.of`` refuses it (a stored row is at least one step).

A stored (stepwise) row of turn steps carries, beside its text steps (``completions``), the field
``TURN_STEPS_FIELD``: ``{"prompt_ids", "response_ids", "step_starts", "step_ends"}`` (the policy's tokens and each
step's first and last model token), from which the same steps come back: ``TurnSteps.from_row`` checks it and names
what is wrong. A PRM reads a turn step from these tokens, not from its text (``prm.turn_rendering``).
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


def model_turns(turns: Sequence[TurnRecord] | None) -> list[TurnRecord]:
    """The turns that are steps, in order: those with a policy token (``end > start``). The one rule of the trainer
    (``grpo_mega.stages.turn_steps``) and of ``grpo-mega prm`` on turns; None (no turn records) gives none."""
    return [turn for turn in turns or [] if turn.end > turn.start]


def step_bounds_of_turns(turns: Sequence[TurnRecord] | None, response_length: int) -> tuple[list[int], list[int]]:
    """(first model token, last model token) response indices of each step (the module docstring): ``turn.start``
    and ``turn.end - 1`` of every turn of :func:`model_turns`; ``([], [])`` for a completion without one.
    ValueError for turns out of order or past the response's ``response_length`` tokens."""
    steps = model_turns(turns)
    starts, ends = [turn.start for turn in steps], [turn.end - 1 for turn in steps]
    if steps:
        check_step_bounds(starts, ends, response_length)
    return starts, ends


def check_step_bounds(step_starts: Sequence[int], step_ends: Sequence[int], response_length: int) -> None:
    """``check_step_ends``, and each step's first model token after the previous step's end and not after its own."""
    check_step_ends(step_ends, response_length)
    if len(step_starts) != len(step_ends):
        raise ValueError(f"{len(step_starts)} step starts for {len(step_ends)} step ends")
    previous = -1
    for k, (start, end) in enumerate(zip(step_starts, step_ends)):
        if isinstance(start, bool) or not isinstance(start, int) or not previous < start <= end:
            raise ValueError(f"step start {k} is {start!r}, not a token after step {k - 1}'s end ({previous}) and "
                             f"up to its own end ({end})")
        previous = end


def step_spans(step_ends: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` response spans of the steps' texts: step k from one past step k-1's end through its own."""
    starts = [0] + [end + 1 for end in step_ends[:-1]]
    return [(start, end + 1) for start, end in zip(starts, step_ends)]


@dataclass(frozen=True)
class TurnSteps:
    """A turn-split rollout: the prompt's and the response's token ids as the policy had them, and the response
    index of each step's first and last model token (its turn's span; the tool turn before it is not the step's
    own)."""

    prompt_ids: list[int]
    response_ids: list[int]
    step_starts: list[int]
    step_ends: list[int]

    def __post_init__(self) -> None:
        check_step_bounds(self.step_starts, self.step_ends, len(self.response_ids))

    @classmethod
    def of(cls, completion: Completion) -> TurnSteps:
        """The turn steps of a rollout's completion (its ``turns``); ValueError for one without a turn that has a
        model token (no step: the module docstring)."""
        ids = list(completion.response_ids)
        starts, ends = step_bounds_of_turns(completion.turns, len(ids))
        if not ends:
            raise ValueError("a completion without an assistant turn that has a model token has no turn step")
        return cls(list(completion.prompt_ids), ids, starts, ends)

    def texts(self, tokenizer: Any) -> list[str]:
        """Each step's text: its span of the response (``step_spans``) decoded as a completion's text is."""
        from grpo_mega.rollout.base import decode_response

        return [decode_response(tokenizer, self.response_ids[start:stop]) for start, stop in step_spans(self.step_ends)]

    def to_row(self) -> dict:
        """The value of ``TURN_STEPS_FIELD`` in a stored row."""
        return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "step_starts": list(self.step_starts), "step_ends": list(self.step_ends)}

    @classmethod
    def from_row(cls, value: Any, num_steps: int) -> TurnSteps:
        """The turn steps stored in a row's ``TURN_STEPS_FIELD`` for a solution of ``num_steps`` text steps;
        ValueError naming the field and what is wrong (the reader adds the file and line)."""
        where = f"field {TURN_STEPS_FIELD!r}"
        names = ("prompt_ids", "response_ids", "step_starts", "step_ends")
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object with {', '.join(names)}, got {value!r:.80}")
        lists = [value.get(name) for name in names]
        for name, values in zip(names, lists):
            if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in values):
                raise ValueError(f"{where}.{name} must be a list of integers, got {values!r:.80}")
        prompt_ids, ids, starts, ends = lists
        if len(ends) != num_steps:
            raise ValueError(f"{where} has {len(ends)} step ends for {num_steps} steps ('completions')")
        try:
            check_step_bounds(starts, ends, len(ids))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        return cls(list(prompt_ids), list(ids), list(starts), list(ends))
