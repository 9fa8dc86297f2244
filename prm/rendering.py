"""The rendering contract shared by labelling, training, scoring and evaluation of a PRM.

An example (prompt, steps) becomes one text::

    prompt + step_1 + tag + step_2 + tag + ... + step_n + tag

where ``tag`` is the step tag (``"<extra_0>"`` for Qwen2.5-Math-PRM, ``" ки"`` for Math-Shepherd). A step's score is
read at the LAST token of the tag that follows it, so the score sees the prompt and every step up to its own. The
``likelihood`` layout has no tag (``step_tag=""``): the text is the prompt and the steps as the policy wrote them, and
a step is read at its own last token (its score depends on all of its tokens, ``prm.heads.StepLikelihoodHead``).

With ``chat_template`` on, the text is the tokenizer's chat template applied to the messages
``[system (optional), user = prompt, assistant = step_1 + tag + ... + step_n + tag]`` (the Qwen2.5-Math-PRM layout);
the template writes its own special tokens, so none are added when tokenizing. Without it, the plain text is
tokenized with the tokenizer's special tokens (a BOS, if the tokenizer adds one, is kept).

Token positions come from the fast tokenizer's offset mapping: the tag's position is the last token whose character
span covers the tag's last character. A tag that shares its last token with another tag, or whose last token runs on
into the next step's text (so the score would see text after the step), is an error: pick a tag the tokenizer keeps
apart (a special token, or a string that starts and ends at token boundaries).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from prm.examples import StepExample


LIKELIHOOD_TOKENS = ("all", "result")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def result_spans(step: str) -> list[tuple[int, int]]:
    """Character spans of a step's result: the numbers after its last ``=``, else all its numbers, else the whole
    step. "so 48 + 24 = 72 clips" -> the span of "72"; "She sold 72 clips in total." -> "72"."""
    tail = step.rfind("=") + 1
    spans = [match.span() for match in _NUMBER.finditer(step, tail)] if tail else []
    spans = spans or [match.span() for match in _NUMBER.finditer(step)]
    return spans or [(0, len(step))]


@dataclass(frozen=True)
class RenderSettings:
    """How (prompt, steps) is written as text; the same settings must be used to label, train, score and evaluate."""

    step_tag: str
    """Text written after every step; its last token carries the step's score. Empty for the ``likelihood``
    layout: the steps as written, each read at its own last token."""
    chat_template: bool = False
    """Wrap the text in the tokenizer's chat template (user = prompt, assistant = tagged steps)."""
    system_prompt: str | None = None
    """System message for the chat template (ignored without it)."""
    likelihood_tokens: str = "all"
    """The ``likelihood`` layout: which tokens of a step its score is the minimum over. ``all``: every token (a
    self-consistency signal; fits steps that are all formula, like the synthetic task's). ``result``: the step's
    result, the numbers after its last ``=`` (all its numbers when it has none; all its tokens when it has no
    number), so the wording of a natural-language step cannot decide its score (``result_spans``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.step_tag, str):
            raise ValueError(f"RenderSettings.step_tag must be a string, got {self.step_tag!r}")
        if self.likelihood_tokens not in LIKELIHOOD_TOKENS:
            raise ValueError(f"likelihood_tokens must be one of {LIKELIHOOD_TOKENS}, got {self.likelihood_tokens!r}")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("RenderSettings.system_prompt needs chat_template=True (plain text has no system turn)")


@dataclass
class RenderedExample:
    """Token ids of a rendered example and, per step, the index of its tag's last token (strictly increasing)."""

    input_ids: list[int]
    tag_positions: list[int]
    step_starts: list[int] | None = None
    """Per step, the index of its first token (the step's tokens run from there to its tag position)."""
    counted: list[list[int]] | None = None
    """``likelihood_tokens="result"``: per step, the indices of the tokens its score is read from (None: all)."""


def _tagged_steps(steps: Sequence[str], tag: str) -> tuple[str, list[int]]:
    """``step_1 + tag + ... + step_n + tag`` and the offset just after each tag."""
    text, ends = "", []
    for step in steps:
        if not step and not tag:
            raise ValueError("an empty step cannot be scored without a step tag")
        text += step + tag
        ends.append(len(text))
    return text, ends


def _step_starts(ends: Sequence[int], steps: Sequence[str], tag: str) -> list[int]:
    """The character offset where each step begins, from the offsets just after the tags."""
    return [end - len(tag) - len(step) for end, step in zip(ends, steps)]


def render(prompt: str, steps: Sequence[str], settings: RenderSettings, tokenizer=None) -> tuple[str, list[int]]:
    """The rendered text and, per step, the character offset just after its tag.

    ``tokenizer`` is needed only with ``settings.chat_template`` (its template writes the text).
    """
    body, ends = _tagged_steps(steps, settings.step_tag)
    if not settings.chat_template:
        return prompt + body, [len(prompt) + end for end in ends]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("RenderSettings.chat_template is on but the tokenizer has no chat template")
    messages = [] if settings.system_prompt is None else [{"role": "system", "content": settings.system_prompt}]
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": body}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return text, _locate_body(text, body, ends, settings.step_tag)


def _locate_body(text: str, body: str, ends: list[int], tag: str) -> list[int]:
    """Tag ends inside the chat-templated ``text``: the assistant body is searched for as written, then stripped
    (templates such as Llama 3's trim message contents); every tag is checked to sit where it is expected."""
    if not body:
        return []
    start = text.rfind(body)
    shift = 0
    if start < 0:
        stripped = body.strip()
        start = text.rfind(stripped) if stripped else -1
        shift = len(body) - len(body.lstrip())
    if start < 0:
        raise ValueError(f"the chat template changed the assistant text; {body[:80]!r}... is not in {text[:200]!r}")
    offsets = [start + end - shift for end in ends]
    for k, offset in enumerate(offsets):
        if text[offset - len(tag) : offset] != tag:
            raise ValueError(f"the chat template moved or trimmed the tag of step {k} ({tag!r}); text: {text[:200]!r}")
    return offsets


def _tag_token_positions(offsets: Sequence[Sequence[int]], tag_ends: Sequence[int], tag: str, where: str) -> list[int]:
    """Index of the last token covering character ``end - 1`` for every tag end; errors as in the module docstring."""
    # Tokens with an empty span (BOS and other added special tokens at (0, 0)) cover no character.
    spans = [(index, start, end) for index, (start, end) in enumerate(offsets) if end > start]
    covering: list[int] = []  # per tag, an index into spans
    cursor = 0
    for step, tag_end in enumerate(tag_ends):
        last_char, found = tag_end - 1, None
        scan = cursor
        while scan < len(spans) and spans[scan][1] <= last_char:
            if last_char < spans[scan][2]:
                found = scan
            scan += 1
        if found is None:
            what = f"step {step}'s tag {tag!r}" if tag else f"step {step}"
            raise ValueError(f"{where}: no token covers the last character of {what}")
        covering.append(found)
        cursor = found
    for step in range(1, len(covering)):
        if covering[step] == covering[step - 1]:
            what = f"the tags of steps {step - 1} and {step} ({tag!r})" if tag else f"steps {step - 1} and {step}"
            raise ValueError(f"{where}: {what} end on the same token")
    for step, (found, tag_end) in enumerate(zip(covering, tag_ends)):
        if spans[found][2] > tag_end:
            if not tag:
                raise ValueError(f"{where}: the last token of step {step} runs on into the next step's text (the "
                                 "tokenizer merges them), so the step cannot be scored on its own tokens")
            raise ValueError(
                f"{where}: the last token of step {step}'s tag {tag!r} runs on past the tag into the text after it; "
                "use a tag the tokenizer keeps as its own token(s)"
            )
    return [spans[found][0] for found in covering]


def _first_token_positions(offsets: Sequence[Sequence[int]], starts: Sequence[int]) -> list[int]:
    """Per character offset, the index of the first token that ends after it (the token holding that character)."""
    spans = [(index, end) for index, (start, end) in enumerate(offsets) if end > start]
    positions, cursor = [], 0
    for start in starts:
        while cursor < len(spans) and spans[cursor][1] <= start:
            cursor += 1
        positions.append(spans[min(cursor, len(spans) - 1)][0])
    return positions


def _result_token_positions(offsets, ends: Sequence[int], steps: Sequence[str], tag: str) -> list[list[int]]:
    """Per step, the tokens overlapping its ``result_spans``."""
    counted = []
    for start, step in zip(_step_starts(ends, steps, tag), steps):
        spans = [(start + a, start + b) for a, b in result_spans(step)]
        counted.append([index for index, (first, last) in enumerate(offsets)
                        if last > first and any(first < b and a < last for a, b in spans)])
    return counted


def _checked(ids: list[int], offsets, ends: list[int], steps: Sequence[str], tag: str, max_length: int | None,
             where: str, likelihood_tokens: str = "all") -> RenderedExample:
    if max_length is not None and len(ids) > max_length:
        raise ValueError(f"{where}: rendered example has {len(ids)} tokens, more than max_length={max_length}")
    counted = _result_token_positions(offsets, ends, steps, tag) if likelihood_tokens == "result" else None
    return RenderedExample(input_ids=list(ids), tag_positions=_tag_token_positions(offsets, ends, tag, where),
                           step_starts=_first_token_positions(offsets, _step_starts(ends, steps, tag)), counted=counted)


def _encode(tokenizer, texts: list[str], settings: RenderSettings) -> tuple[list[list[int]], list]:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"PRM rendering needs a fast tokenizer (offset mapping); got {type(tokenizer).__name__}")
    encoded = tokenizer(texts, add_special_tokens=not settings.chat_template, return_offsets_mapping=True)
    return encoded["input_ids"], encoded["offset_mapping"]


def tokenize_rendered(
    tokenizer, prompt: str, steps: Sequence[str], settings: RenderSettings, *, max_length: int | None = None
) -> RenderedExample:
    """Render (prompt, steps), tokenize it, and find each tag's last token; ValueError as in the module docstring."""
    text, ends = render(prompt, steps, settings, tokenizer)
    ids, offsets = _encode(tokenizer, [text], settings)
    return _checked(ids[0], offsets[0], ends, steps, settings.step_tag, max_length, "rendered example",
                    settings.likelihood_tokens)


def tokenize_many(
    tokenizer, examples: Sequence["StepExample"], settings: RenderSettings, max_length: int | None = None
) -> list[RenderedExample]:
    """``tokenize_rendered`` for many examples in one tokenizer call; errors name the example's source."""
    rendered = []
    for index, example in enumerate(examples):
        try:
            rendered.append(render(example.prompt, example.steps, settings, tokenizer))
        except ValueError as error:
            raise ValueError(f"{example.source or f'example {index}'}: {error}") from None
    if not rendered:
        return []
    ids, offsets = _encode(tokenizer, [text for text, _ in rendered], settings)
    return [
        _checked(ids[i], offsets[i], ends, example.steps, settings.step_tag, max_length,
                 example.source or f"example {i}", settings.likelihood_tokens)
        for i, ((_, ends), example) in enumerate(zip(rendered, examples))
    ]
