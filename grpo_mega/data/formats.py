"""The layout of a prompt dataset's rows: which field holds the prompt (a text, or a conversation) and which the
answer, chosen per file by ``data.format`` (``data.eval_format`` for the eval file) from the file's first row.

Formats (field names are dotted paths, ``grpo_mega.data.fields``):

- ``plain``: the prompt text in ``prompt_field``, the answer in ``answer_field`` (``{"prompt": ..., "answer": ...}``).
- ``chat``: a ``[{role, content}, ...]`` conversation in ``messages_field`` (``messages`` when unset), the answer in
  ``answer_field``.
- ``verl``: verl's RL parquet (its ``examples/data_preprocess`` scripts: GSM8K, MATH, DAPO-Math): the conversation in
  ``prompt_field`` (verl's ``prompt``), the answer in ``reward_model.ground_truth``; ``data_source``, ``ability``,
  ``reward_model`` and ``extra_info`` stay in the record's extra fields.
- ``trl``: TRL's prompt-only datasets: ``prompt_field`` (``prompt``) holds a text (standard) or a conversation
  (conversational); the answer in ``answer_field``, or TRL's ``solution`` as for ``auto``.
- ``auto`` (the default): from the first row that is an object, in this order: ``messages_field`` (when set) holds a
  conversation -> ``chat``; ``prompt_field`` holds a text -> ``plain``; ``prompt_field`` holds a conversation ->
  ``verl`` when the answer is verl's ``reward_model.ground_truth``, else ``trl`` (conversational); a ``messages``
  field holds a conversation (``prompt_field`` left at ``prompt``) -> ``chat``; else ``plain`` (whose rows then
  fail naming the fields they have). The answer is
  ``answer_field`` when the row has it or when it is not the default ``answer``, else the first of
  ``KNOWN_ANSWERS`` the row has (verl's ``reward_model.ground_truth``, TRL's ``solution``): a field the user named
  is never replaced by a guess.

A configured ``prompt_field`` that the first row lacks does not hide a layout the row shows (``auto`` and ``trl``):
the row is read as if the key were unset (verl's or TRL's ``prompt``, a ``messages`` conversation), with a
:attr:`RowLayout.note` saying so; ``verl`` reads verl's ``prompt`` unless ``prompt_field`` holds a conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_mega.data.fields import field_value, has_field

FORMATS = ("auto", "plain", "chat", "verl", "trl")
DEFAULT_PROMPT, DEFAULT_ANSWER = "prompt", "answer"
VERL_ANSWER = "reward_model.ground_truth"
"""Where verl's RL parquet files keep the reference answer (``reward_model: {style: rule, ground_truth: ...}``)."""
KNOWN_ANSWERS = (VERL_ANSWER, "solution")
"""Where ``auto`` looks for the answer of a row without ``answer_field``, in order: verl's, then TRL's (its math
datasets and ``accuracy_reward(completions, solution)`` name the column ``solution``)."""


@dataclass(frozen=True)
class FieldSettings:
    """The ``data.*`` keys that say how rows are read."""

    format: str = "auto"
    prompt_field: str = DEFAULT_PROMPT
    messages_field: str | None = None
    answer_field: str | None = DEFAULT_ANSWER

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")


def field_settings(data: Any, *, eval_file: bool = False) -> FieldSettings:
    """The FieldSettings of a run config's ``data`` section for its train file or (``eval_file``) its eval file,
    which ``data.eval_format`` reads when set."""
    chosen = data.eval_format if eval_file and data.eval_format is not None else data.format
    return FieldSettings(chosen, data.prompt_field, data.messages_field, data.answer_field)


@dataclass(frozen=True)
class RowLayout:
    """How the rows of one file are read."""

    format: str
    """``plain``, ``chat``, ``verl`` or ``trl``."""
    prompt_field: str
    """Dotted path of the prompt: a text, or with ``conversation`` a list of system / user turns."""
    conversation: bool
    """The prompt field holds a ``[{role, content}, ...]`` conversation ending with a user turn."""
    answer_field: str | None
    """Dotted path of the reference answer; None: the rows have none."""
    detected: bool = False
    """Chosen by ``auto`` from the file's first row."""
    note: str = ""
    """Which setting won where the config's field keys and the file's rows disagree (a configured prompt field the
    rows lack, a verl file read by verl's ``prompt``): one line the CLI prints before launch; ``""``: none."""

    def describe(self) -> str:
        """``"verl (detected): conversation in 'prompt', answer in 'reward_model.ground_truth'"``."""
        what = "conversation" if self.conversation else "prompt text"
        answer = f"answer in {self.answer_field!r}" if self.answer_field is not None else "no answer field"
        return f"{self.format}{' (detected)' if self.detected else ''}: {what} in {self.prompt_field!r}, {answer}"


def looks_like_conversation(value: Any) -> bool:
    """A non-empty list of objects with a ``role`` (checked in full when the row is read)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def choose_layout(settings: FieldSettings, first_row: Any) -> RowLayout:
    """The layout of a file whose first object row is ``first_row`` (None: the file has no object row; ``auto``
    then reads ``plain``)."""
    answer = settings.answer_field
    if settings.format == "plain":
        return RowLayout("plain", settings.prompt_field, False, answer)
    if settings.format == "chat":
        return RowLayout("chat", settings.messages_field or "messages", True, answer)
    row = first_row if isinstance(first_row, dict) else {}
    if settings.format == "verl":  # verl's layout whatever the plain-prompt keys say: its conversation in `prompt`
        if looks_like_conversation(_value(row, settings.prompt_field)) or settings.prompt_field == DEFAULT_PROMPT:
            return RowLayout("verl", settings.prompt_field, True, VERL_ANSWER)
        return RowLayout("verl", DEFAULT_PROMPT, True, VERL_ANSWER,
                         note=f"data.format=verl: verl's conversation in {DEFAULT_PROMPT!r} read (data.prompt_field="
                              f"{settings.prompt_field!r} holds no conversation in these rows)")
    missing = settings.prompt_field != DEFAULT_PROMPT and not has_field(row, settings.prompt_field)
    if missing and settings.format in ("auto", "trl") and row and not (
            settings.messages_field is not None and looks_like_conversation(_value(row, settings.messages_field))):
        # a config's field key must not hide a layout the rows show: read them as if the key were unset, and say so
        fallback = choose_layout(FieldSettings(settings.format, DEFAULT_PROMPT, None, settings.answer_field), row)
        if has_field(row, fallback.prompt_field):
            return RowLayout(fallback.format, fallback.prompt_field, fallback.conversation, fallback.answer_field,
                             fallback.detected, note=f"the rows have no data.prompt_field={settings.prompt_field!r}: "
                                                     f"read as {fallback.describe()}")
    prompt = _value(row, settings.prompt_field)
    if answer == DEFAULT_ANSWER and not has_field(row, answer):  # a field the user named is never replaced
        answer = next((known for known in KNOWN_ANSWERS if has_field(row, known)), answer)
    if settings.format == "trl":
        return RowLayout("trl", settings.prompt_field, looks_like_conversation(prompt), answer)
    if settings.messages_field is not None and looks_like_conversation(_value(row, settings.messages_field)):
        return RowLayout("chat", settings.messages_field, True, answer, detected=True)
    if isinstance(prompt, str):
        return RowLayout("plain", settings.prompt_field, False, answer, detected=True)
    if looks_like_conversation(prompt):
        return RowLayout("verl" if answer == VERL_ANSWER else "trl", settings.prompt_field, True, answer, detected=True)
    if settings.prompt_field == DEFAULT_PROMPT and looks_like_conversation(_value(row, "messages")):
        return RowLayout("chat", "messages", True, answer, detected=True)
    # no conversation where one was looked for: the rows then say that the prompt field is missing, naming the fields
    # they have (and a field holding a conversation, if one does)
    return RowLayout("plain", settings.prompt_field, False, answer, detected=True)


def _value(row: dict, path: str) -> Any:
    return field_value(row, path) if has_field(row, path) else None
