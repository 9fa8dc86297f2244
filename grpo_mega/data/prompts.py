"""Prompt datasets for GRPO: rows from jsonl or parquet files, formatted, tokenized, checked; resumable batches.

A row needs a prompt field, or a messages field holding a conversation (TRL's conversational prompts:
``[{role, content}, ...]`` of system / user turns ending with a user turn), and (unless ``answer_field`` is None) an
answer field; every other field is kept in ``PromptRecord.extra`` for reward functions. Prompts are formatted with
the tokenizer's chat template and its generation prompt when it has one (and ``use_chat_template`` is on), otherwise
with a plain format string such as ``"Q: {prompt} A:"``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from grpo_mega.data.chat import ChatFormat, ChatFormatError, check_messages, user_turn

logger = logging.getLogger(__name__)

BAD_ROW_POLICIES = ("skip", "error")
_MAX_SKIP_WARNINGS = 10  # per load; the summary line still counts every skipped row


@dataclass(frozen=True)
class PromptRecord:
    """One usable row: the formatted prompt text and its token ids, the gold answer, the other fields."""

    prompt: str
    """The text the policy is given (after chat template or format string)."""
    prompt_ids: list[int]
    """Token ids of ``prompt``, special tokens included as the tokenizer adds them."""
    answer: str | None
    """Gold answer as text (numbers are converted with str()); None when the dataset has no answer field."""
    raw_prompt: str
    """The prompt field as stored in the file (a conversation's last user turn)."""
    source: str
    """Where the row came from, ``file:line`` (jsonl) or ``file:row N`` (parquet)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's remaining fields, passed on to reward functions."""


@dataclass
class PromptDataset:
    """Usable records in file order plus a message for every skipped row."""

    records: list[PromptRecord]
    skipped: list[str]

    def __len__(self) -> int:
        return len(self.records)


class BadRowError(ValueError):
    """A row of a prompt dataset is malformed or too long (raised when ``on_bad_row='error'``)."""


def _rows_from_jsonl(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(location, row or None, parse error or None) for every non-blank line."""
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            location = f"{path}:{line_number}"
            try:
                yield location, json.loads(line), None
            except json.JSONDecodeError as error:
                yield location, None, f"invalid JSON ({error.msg} at column {error.colno})"


def _rows_from_parquet(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(location, row, None) for every row of a parquet file; needs pyarrow."""
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from error
    for row_number, row in enumerate(parquet.read_table(path).to_pylist(), start=1):
        yield f"{path}:row {row_number}", row, None


def read_rows(path: str | Path) -> Iterator[tuple[str, Any, str | None]]:
    """Rows of a ``.jsonl`` or ``.parquet`` file as (location, row, error); other suffixes raise ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset file {path} does not exist")
    if path.suffix == ".jsonl":
        return _rows_from_jsonl(path)
    if path.suffix == ".parquet":
        return _rows_from_parquet(path)
    raise ValueError(f"prompt dataset file {path}: unsupported suffix {path.suffix!r}; expected .jsonl or .parquet")


class PromptFormatter:
    """Turns a raw prompt into the policy's input text and ids: chat template if available, else a format string
    (``grpo_mega.data.chat``, the rendering SFT trains on)."""

    def __init__(self, tokenizer, use_chat_template: bool = True, prompt_format: str = "{prompt}") -> None:
        self.format = ChatFormat(tokenizer, use_chat_template, prompt_format)
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.uses_chat_template = self.format.uses_chat_template

    def __call__(self, raw_prompt: str | list[dict]) -> tuple[str, list[int]]:
        """(formatted text, token ids) of a prompt text or a conversation ending with a user turn. A chat template
        writes its own special tokens, so none are added then."""
        return self.format.render_prompt(user_turn(raw_prompt) if isinstance(raw_prompt, str) else raw_prompt)


class BadRows:
    """The ``data.on_bad_row`` policy for one load: ``error`` raises BadRowError naming ``file:line``; ``skip``
    logs the first few, keeps every ``"file:line: why"`` in ``skipped`` and summarises at the end."""

    def __init__(self, policy: str) -> None:
        if policy not in BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {policy!r}")
        self.policy = policy
        self.skipped: list[str] = []

    def reject(self, location: str, error: str) -> None:
        """Handle one bad row: raise under ``error``, else record and (the first few) log it."""
        if self.policy == "error":
            raise BadRowError(f"{location}: {error}")
        if len(self.skipped) < _MAX_SKIP_WARNINGS:
            logger.warning("skipping %s: %s", location, error)
        self.skipped.append(f"{location}: {error}")

    def finish(self, kept: int, source: str) -> None:
        """Log how many rows were skipped; raise when no row of ``source`` was usable."""
        if self.skipped:
            logger.warning("skipped %d of %d rows in %s", len(self.skipped), len(self.skipped) + kept, source)
        if not kept:
            first = self.skipped[:1]
            raise ValueError(f"no usable rows in {source} ({len(self.skipped)} skipped; first: {first})")


def check_row(row: Any, prompt_field: str, answer_field: str | None, *, answer_key: str = "data.answer_field",
              answer_kind: str = "answer") -> str | None:
    """Why the row is unusable (not an object, no non-empty string prompt, no scalar answer), or None. A missing
    field's message names the config key that chooses it (``data.prompt_field``, ``answer_key``) and the row's
    fields, so the fix is one override away."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    conversations = [name for name, value in row.items() if _looks_like_conversation(value)]
    read_as_chat = (f"; to read its conversation set data.messages_field={conversations[0]} data.chat_template=true"
                    if conversations else "")
    if prompt_field not in row:
        return (f"missing prompt field {prompt_field!r}; set data.prompt_field to the field that holds the prompt "
                f"text (this row has {sorted(row)}){read_as_chat}")
    if not isinstance(row[prompt_field], str) or not row[prompt_field].strip():
        return (f"prompt field {prompt_field!r} must be a non-empty string, got {row[prompt_field]!r:.60}"
                f"{read_as_chat}")
    return check_answer(row, answer_field, answer_key=answer_key, answer_kind=answer_kind)


def check_conversation_row(row: Any, messages_field: str, answer_field: str | None) -> str | None:
    """Why a conversation row is unusable (no ``messages_field`` list of system / user turns ending with a user
    turn, no scalar answer), or None; a missing field's message names the options that would read the row."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if messages_field not in row:
        texts = [name for name, value in row.items() if isinstance(value, str) and name != answer_field]
        plain = f", or data.messages_field=null data.prompt_field={texts[0]} for a prompt text" if texts else ""
        return (f"missing messages field {messages_field!r}; set data.messages_field to the field that holds the "
                f"conversation{plain} (this row has {sorted(row)})")
    try:
        check_messages(row[messages_field], final_role="user")
    except ChatFormatError as error:
        return f"{messages_field}: {error} (a prompt conversation ends with the user's turn)"
    return check_answer(row, answer_field)


def _looks_like_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def check_answer(row: dict, answer_field: str | None, *, answer_key: str = "data.answer_field",
                 answer_kind: str = "answer") -> str | None:
    """Why ``row``'s answer field is unusable (missing, not a string or number), or None."""
    if answer_field is not None:
        if answer_field not in row:
            return (f"missing {answer_kind} field {answer_field!r}; set {answer_key} to the field that holds the "
                    f"{answer_kind} (this row has {sorted(row)})")
        if row[answer_field] is None or isinstance(row[answer_field], (dict, list)):
            return f"{answer_kind} field {answer_field!r} must be a string or number, got {row[answer_field]!r:.60}"
    return None


def load_prompt_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer,
    *,
    prompt_length: int,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    on_bad_row: str = "skip",
    use_chat_template: bool = True,
    prompt_format: str = "{prompt}",
    messages_field: str | None = None,
) -> PromptDataset:
    """Read, format and tokenize prompt rows from jsonl/parquet files: the text of ``prompt_field``, or with
    ``messages_field`` the conversation it holds (system / user turns ending with a user turn).

    A row is bad when it is not valid JSON, not an object, lacks the prompt (or messages) or answer field, or its
    formatted prompt is longer than ``prompt_length`` tokens. With ``on_bad_row='error'`` the first bad row raises
    BadRowError naming ``file:line``; with ``'skip'`` it is left out, logged, and listed in ``skipped``.
    """
    bad_rows = BadRows(on_bad_row)
    if prompt_length <= 0:
        raise ValueError(f"prompt_length must be positive, got {prompt_length}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise ValueError("load_prompt_dataset: no files given")
    formatter = PromptFormatter(tokenizer, use_chat_template, prompt_format)
    if messages_field is not None and not formatter.uses_chat_template:
        raise ValueError(f"messages_field={messages_field!r}: conversations are rendered with the tokenizer's chat "
                         "template, and the tokenizer has none (or the chat template is off)")
    source_field = prompt_field if messages_field is None else messages_field
    records: list[PromptRecord] = []
    for path in paths:
        for location, row, error in read_rows(path):
            error = error or (check_row(row, prompt_field, answer_field) if messages_field is None
                              else check_conversation_row(row, messages_field, answer_field))
            if error is None:
                text, ids = formatter(row[source_field])
                if len(ids) > prompt_length:
                    error = f"prompt has {len(ids)} tokens, more than prompt_length={prompt_length}"
            if error is not None:
                bad_rows.reject(location, error)
                continue
            answer = None if answer_field is None else str(row[answer_field])
            extra = {k: v for k, v in row.items() if k not in (source_field, answer_field)}
            raw = row[source_field] if messages_field is None else row[source_field][-1]["content"]
            records.append(PromptRecord(text, ids, answer, raw, location, extra))
    bad_rows.finish(len(records), ", ".join(map(str, paths)))
    return PromptDataset(records=records, skipped=bad_rows.skipped)


class PromptBatches:
    """Endless iterator over batches of ``records``, reshuffled every epoch, resumable from ``state_dict()``.

    Epoch e visits the records in the order ``numpy.random.default_rng([seed, e]).permutation(n)`` (or file order
    when ``shuffle`` is off) in batches of ``batch_size``; the last ``n % batch_size`` records of an epoch's order
    are dropped so every batch is full, and a batch never spans two epochs.
    """

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(records) < batch_size:
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({len(records)} records)")
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next batch's first record
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    @property
    def batches_per_epoch(self) -> int:
        """Full batches in one epoch."""
        return len(self.records) // self.batch_size

    def __iter__(self) -> "PromptBatches":
        return self

    def __next__(self) -> list[PromptRecord]:
        if self.position + self.batch_size > len(self.records):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.records[i] for i in indices]

    def state_dict(self) -> dict[str, int | bool]:
        """Where the iterator stands, plus the settings it must be resumed with."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` left off; a different dataset size or batch settings raise ValueError."""
        for key in ("seed", "shuffle", "batch_size", "num_records"):
            current = len(self.records) if key == "num_records" else getattr(self, key)
            if state.get(key) != current:
                raise ValueError(
                    f"PromptBatches.load_state_dict: saved {key}={state.get(key)!r} but this iterator has {current!r}; "
                    "resuming would not continue at the same place"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
