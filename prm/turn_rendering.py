"""How a PRM reads turn steps (``prm.turn_steps``): from the policy's token ids, not from their text (token in).

Re-tokenizing a multi-turn response's text does not give its tokens back: the tool turn is encoded on its own right
after the policy's last sampled token, and BPE merges across that boundary (the tool task's tokenizer writes
``</tool_call><tool_response>`` with one token ``><``), so a step's end would fall inside a token. A turn step is
therefore rendered from its ``TurnSteps``::

    input_ids = prompt_ids + response[span_1] + tag_ids + response[span_2] + tag_ids + ...

``span_k`` is step k's response span (``step_spans``: the tool turn that answered turn k-1, then turn k's model
tokens) and ``tag_ids`` the step tag's own tokens (``tokenizer.encode(step_tag)``; none for the ``likelihood``
layout). Step k's score is read at its tag's last token (without a tag, at its last model token), so it sees the
prompt, every earlier turn and tool output and its own turn, never the tool turn that answers it. The ``likelihood``
layout's minimum runs over the step's model tokens only (its turn's span): a tool's output is not the policy's.

The prompt is the policy's prompt ids as it was given them (its chat template, if it used one); the PRM's
``chat_template`` setting does not wrap them again. So the PRM must read the policy's tokenizer (a PRM trained from
the policy, as ``prm train`` with ``model.init_from`` the policy is); an id the PRM's vocabulary does not have is an
error. The same function renders a stored row (``prm train`` / ``score`` / ``eval``) and a rollout's completion (the
trainer's ``process_reward.steps: turns``): the same tokens and positions by construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from prm.rendering import RenderedExample, RenderSettings, tokenize_rendered
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps, step_spans

if TYPE_CHECKING:
    from prm.examples import StepExample


def tag_ids_of(tokenizer, settings: RenderSettings) -> list[int]:
    """The step tag's token ids (none for an empty tag)."""
    return list(tokenizer.encode(settings.step_tag, add_special_tokens=False)) if settings.step_tag else []


def render_turn_steps(steps: TurnSteps, tag_ids: Sequence[int], *, num_steps: int | None = None,
                      max_length: int | None = None, vocab_size: int | None = None,
                      where: str = "turn steps") -> RenderedExample:
    """The rendered example of the first ``num_steps`` (default all) turn steps (module docstring); ValueError
    naming ``where`` when it is longer than ``max_length`` or holds an id outside ``vocab_size``."""
    count = len(steps.step_ends) if num_steps is None else num_steps
    if not 1 <= count <= len(steps.step_ends):
        raise ValueError(f"{where}: {count} steps asked of {len(steps.step_ends)}")
    ids = list(steps.prompt_ids)
    tag_positions, starts = [], []
    for (start, stop), first in zip(step_spans(steps.step_ends)[:count], steps.step_starts):
        starts.append(len(ids) + first - start)
        ids += steps.response_ids[start:stop] + list(tag_ids)
        tag_positions.append(len(ids) - 1)
    if max_length is not None and len(ids) > max_length:
        raise ValueError(f"{where}: rendered example has {len(ids)} tokens, more than max_length={max_length}")
    if vocab_size is not None and ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(f"{where}: token id {max(ids) if max(ids) >= vocab_size else min(ids)} is outside the PRM "
                         f"tokenizer's {vocab_size} ids: turn steps are read as the policy's token ids, so the PRM "
                         "needs the policy's tokenizer")
    return RenderedExample(input_ids=ids, tag_positions=tag_positions, step_starts=starts)


def render_example(tokenizer, example: StepExample, settings: RenderSettings, *, num_steps: int | None = None,
                   max_length: int | None = None) -> RenderedExample:
    """An example as the PRM reads it: a turn-split row (``turn_steps`` in its ``extra``) from its tokens, any other
    from its text (``prm.rendering.tokenize_rendered``); the first ``num_steps`` steps (default all)."""
    stored = example.extra.get(TURN_STEPS_FIELD)
    if stored is None:
        steps = example.steps if num_steps is None else example.steps[:num_steps]
        return tokenize_rendered(tokenizer, example.prompt, steps, settings, max_length=max_length)
    where = example.source or "turn-split example"
    if settings.likelihood_tokens != "all":
        raise ValueError(f"{where}: likelihood_tokens={settings.likelihood_tokens!r} reads a text step's result; "
                         "turn steps are read on all their model tokens (likelihood_tokens: all)")
    turn_steps = TurnSteps.from_row(stored, len(example.steps))
    return render_turn_steps(turn_steps, tag_ids_of(tokenizer, settings), num_steps=num_steps, max_length=max_length,
                             vocab_size=len(tokenizer), where=where)


def render_turn_split(tokenizer, examples: Sequence[StepExample], settings: RenderSettings, *,
                      max_length: int | None = None) -> tuple[list[int], list[RenderedExample]]:
    """What a scorer's ``score_examples`` scores of examples of which some are turn-split rows: (the indices of the
    examples with a step, each rendered by :func:`render_example`); an example without a step keeps no score."""
    with_steps = [i for i, e in enumerate(examples) if e.steps]
    return with_steps, [render_example(tokenizer, examples[i], settings, max_length=max_length) for i in with_steps]
