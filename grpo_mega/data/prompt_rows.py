"""The rows of one prompt file read with its layout (``grpo_mega.data.formats``) and checked, before any tokenizer:
what the ranks' loader (``grpo_mega.data.prompts``) builds records from and what the CLI checks before it starts
them (``grpo_mega.config.preflight``), so both refuse the same rows with the same words.

A row is unusable when it is not an object, its prompt field is missing or not a non-empty text (a conversation of
system / user turns ending with a user turn, for conversation layouts), or its answer field is missing or not a
string or number. Each message names the field, the config key that chooses it and the fields the row has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from grpo_mega.data.chat import ChatFormatError, check_messages
from grpo_mega.data.fields import FieldError, field_value
from grpo_mega.data.formats import FieldSettings, RowLayout, choose_layout, looks_like_conversation
from grpo_mega.data.sources import read_rows


class BadRowError(ValueError):
    """A row of a prompt dataset is malformed or too long (raised when ``on_bad_row='error'``), or no row of a file
    is usable; the message names the file, the row and the field."""


@dataclass
class LayoutRow:
    """One row of a file: where it is, the row, the file's layout (None before the file's first object row) and why
    it is unusable (None: usable)."""

    location: str
    row: Any
    layout: RowLayout | None
    error: str | None


def layout_rows(path: str | Path, settings: FieldSettings, *, one_turn: bool = False) -> Iterator[LayoutRow]:
    """Every row of ``path`` (a file, a folder of shards, a save_to_disk folder: ``grpo_mega.data.sources``) with
    the layout chosen from its first object row, checked; ``one_turn``: conversations are rendered without a chat
    template, so only those of one user turn are usable."""
    layout: RowLayout | None = None
    for location, row, error in read_rows(path):
        if layout is None and error is None and isinstance(row, dict):
            layout = choose_layout(settings, row)
        if error is None:
            error = check_layout_row(row, layout, one_turn=one_turn) if layout is not None else _not_an_object(row)
        yield LayoutRow(location, row, layout, error)


def file_layout(path: str | Path, settings: FieldSettings) -> RowLayout | None:
    """The layout ``settings`` choose for ``path`` from its first object row (None: it has none)."""
    return next((item.layout for item in layout_rows(path, settings) if item.layout is not None), None)


def usable_rows(path: str | Path, settings: FieldSettings, count: int) -> Iterator[tuple[str, Any, Any, dict]]:
    """(location, prompt, answer, other top-level columns) of the first ``count`` usable rows of ``path``, read as
    the ranks read them (a conversation's prompt is its last user turn; the answer as text; the columns other than
    the prompt's and the answer's, a nested answer's column kept whole)."""
    if count <= 0:
        return
    for item in layout_rows(path, settings):
        if item.error is not None:
            continue
        layout, row = item.layout, item.row
        prompt = field_value(row, layout.prompt_field)
        answer = None if layout.answer_field is None else str(field_value(row, layout.answer_field))
        extra = {k: v for k, v in row.items() if k not in (layout.prompt_field, layout.answer_field)}
        yield item.location, prompt[-1]["content"] if layout.conversation else prompt, answer, extra
        count -= 1
        if count == 0:
            return


@dataclass
class FileScan:
    """What :func:`scan_prompt_file` found: the layout, the usable row count, the bad rows' ``location: why``."""

    layout: RowLayout | None
    usable: int = 0
    bad: list[str] = field(default_factory=list)


def scan_prompt_file(path: str | Path, settings: FieldSettings, on_bad_row: str, *,
                     one_turn: bool = False) -> FileScan:
    """Read and check every row of ``path`` without a tokenizer (the CLI's check before launch; ``one_turn`` as for
    :func:`layout_rows`): BadRowError at the first bad row under ``on_bad_row='error'`` or when no row is usable;
    otherwise the count of usable rows and the bad ones (which the ranks skip and report)."""
    scan = FileScan(layout=None)
    for item in layout_rows(path, settings, one_turn=one_turn):
        scan.layout = scan.layout or item.layout
        if item.error is None:
            scan.usable += 1
            continue
        if on_bad_row == "error":
            raise BadRowError(f"{item.location}: {item.error}")
        scan.bad.append(f"{item.location}: {item.error}")
    if not scan.usable:
        raise BadRowError(f"none of its {len(scan.bad)} rows is usable; the first: {scan.bad[0]}" if scan.bad
                          else "it holds no rows")
    return scan


def check_layout_row(row: Any, layout: RowLayout, *, one_turn: bool = False) -> str | None:
    """Why ``row`` is unusable as a row of ``layout`` (with ``one_turn``: a conversation of more than one turn too),
    or None."""
    if not layout.conversation:
        return check_row(row, layout.prompt_field, layout.answer_field)
    error = check_conversation_row(row, layout.prompt_field, layout.answer_field)
    if error is None and one_turn and len(messages := field_value(row, layout.prompt_field)) > 1:
        error = (f"{layout.prompt_field}: a conversation of {len(messages)} turns "
                 f"({', '.join(m['role'] for m in messages)}) is rendered by a chat template, and the tokenizer has "
                 "none (or data.chat_template=false); without one only a conversation of one user turn is read, as "
                 "its text")
    return error


def _not_an_object(row: Any) -> str | None:
    return None if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"


def check_row(row: Any, prompt_field: str, answer_field: str | None, *, answer_key: str = "data.answer_field",
              answer_kind: str = "answer") -> str | None:
    """Why the row is unusable (not an object, no non-empty string prompt, no scalar answer), or None. Fields are
    dotted paths. A missing field's message names the config key that chooses it (``data.prompt_field``,
    ``answer_key``) and the row's fields, so the fix is one override away."""
    if not isinstance(row, dict):
        return _not_an_object(row)
    conversations = [name for name, value in row.items() if looks_like_conversation(value)]
    read_as_chat = (f"; to read its conversation set data.messages_field={conversations[0]} data.chat_template=true"
                    if conversations else "")
    try:
        prompt = field_value(row, prompt_field)
    except FieldError as error:
        return (f"missing prompt field {prompt_field!r}{_nested(prompt_field, row, error)}; set data.prompt_field to "
                f"the field that holds the prompt text (this row has {sorted(row)}){read_as_chat}")
    if not isinstance(prompt, str) or not prompt.strip():
        return f"prompt field {prompt_field!r} must be a non-empty string, got {prompt!r:.60}{read_as_chat}"
    return check_answer(row, answer_field, answer_key=answer_key, answer_kind=answer_kind)


def check_conversation_row(row: Any, messages_field: str, answer_field: str | None) -> str | None:
    """Why a conversation row is unusable (no ``messages_field`` list of system / user turns ending with a user
    turn, no scalar answer), or None; a missing field's message names the options that would read the row."""
    if not isinstance(row, dict):
        return _not_an_object(row)
    try:
        messages = field_value(row, messages_field)
    except FieldError as error:
        texts = [name for name, value in row.items() if isinstance(value, str) and name != answer_field]
        plain = f", or data.messages_field=null data.prompt_field={texts[0]} for a prompt text" if texts else ""
        return (f"missing messages field {messages_field!r}{_nested(messages_field, row, error)}; set "
                f"data.messages_field to the field that holds the conversation{plain} (this row has {sorted(row)})")
    try:
        check_messages(messages, final_role="user")
    except ChatFormatError as error:
        return f"{messages_field}: {error} (a prompt conversation ends with the user's turn)"
    return check_answer(row, answer_field)


def check_answer(row: dict, answer_field: str | None, *, answer_key: str = "data.answer_field",
                 answer_kind: str = "answer") -> str | None:
    """Why ``row``'s answer field (a dotted path) is unusable (missing, not a string or number), or None."""
    if answer_field is None:
        return None
    try:
        answer = field_value(row, answer_field)
    except FieldError as error:
        return (f"missing {answer_kind} field {answer_field!r}{_nested(answer_field, row, error)}; set {answer_key} "
                f"to the field that holds the {answer_kind} (this row has {sorted(row)})")
    if answer is None or isinstance(answer, (dict, list)):
        return f"{answer_kind} field {answer_field!r} must be a string or number, got {answer!r:.60}"
    return None


def _nested(path: str, row: dict, error: FieldError) -> str:
    """The reason a dotted path broke, for a path that is not one top-level column."""
    return f" ({error})" if "." in path and path not in row else ""
