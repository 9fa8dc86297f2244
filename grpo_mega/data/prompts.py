"""Prompt datasets for GRPO: rows read (``sources``: files, folders of shards, save_to_disk folders) with each
file's layout (``formats``: plain prompts, chat conversations, verl's and TRL's datasets), checked
(``prompt_rows``), formatted, tokenized; resumable batches.

A row needs a prompt (a text, or a conversation: ``[{role, content}, ...]`` of system / user turns ending with a user
turn) and (unless ``answer_field`` is None) an answer; every other top-level column is kept in
``PromptRecord.extra`` for reward functions. Prompts are formatted with the tokenizer's chat template and its
generation prompt when it has one (and ``use_chat_template`` asks for it), otherwise with a plain format string such
as ``"Q: {prompt} A:"``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from grpo_mega.data.chat import ChatFormat, ChatFormatError, user_turn
from grpo_mega.data.fields import field_value
from grpo_mega.data.formats import FieldSettings, RowLayout
from grpo_mega.data.prompt_rows import (BadRowError, check_answer, check_conversation_row, check_row,  # noqa: F401
                                        layout_rows)
from grpo_mega.data.sources import read_rows  # noqa: F401  (the readers of SFT and the PRM import it from here)
from grpo_mega.run.progress import note_skipped_rows

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


class PromptFormatter:
    """Turns a raw prompt into the policy's input text and ids: chat template if available, else a format string
    (``grpo_mega.data.chat``, the rendering SFT trains on)."""

    def __init__(self, tokenizer, use_chat_template: bool = True, prompt_format: str = "{prompt}",
                 tools: list[dict] | None = None) -> None:
        self.format = ChatFormat(tokenizer, use_chat_template, prompt_format, tuple(tools) if tools else None)
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.uses_chat_template = self.format.uses_chat_template

    def __call__(self, raw_prompt: str | list[dict]) -> tuple[str, list[int]]:
        """(formatted text, token ids) of a prompt text or a conversation ending with a user turn. A chat template
        writes its own special tokens, so none are added then."""
        return self.format.render_prompt(user_turn(raw_prompt) if isinstance(raw_prompt, str) else raw_prompt)


def _speaks() -> bool:
    """Whether this process reports bad rows: rank 0 of a job (every rank reads the same files and finds the same
    rows; each said so, once per rank), or a process outside one."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return not rank.isdigit() or int(rank) == 0


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
        if len(self.skipped) < _MAX_SKIP_WARNINGS and _speaks():
            logger.warning("skipping %s: %s", location, error)
        self.skipped.append(f"{location}: {error}")

    def finish(self, kept: int, source: str) -> None:
        """Log how many rows were skipped; raise when no row of ``source`` was usable."""
        if self.skipped:
            if _speaks():
                logger.warning("skipped %d of %d rows in %s", len(self.skipped), len(self.skipped) + kept, source)
            note_skipped_rows(source, len(self.skipped), self.skipped[0])  # for the run's `done` line
        if not kept:
            first = self.skipped[:1]
            raise BadRowError(f"no usable rows in {source} ({len(self.skipped)} skipped; first: {first})")


def load_prompt_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer,
    *,
    prompt_length: int,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    on_bad_row: str = "skip",
    use_chat_template: bool | None = True,
    prompt_format: str = "{prompt}",
    messages_field: str | None = None,
    format: str = "auto",
    tools: list[dict] | None = None,
) -> PromptDataset:
    """Read, format and tokenize prompt rows from files, folders of shards or save_to_disk folders
    (``grpo_mega.data.sources``), each file with the layout ``format`` chooses from its first row
    (``grpo_mega.data.formats``: the text of ``prompt_field``, or a conversation of system / user turns ending with
    a user turn; the answer of ``answer_field``; fields are dotted paths).

    ``tools``: the tools' JSON schemas, given to the chat template as ``tools=`` (multi-turn rollouts).

    ``use_chat_template``: True renders every prompt with the tokenizer's chat template (conversations need one);
    None renders conversations with it (when the tokenizer has one; else a one-turn conversation as
    ``prompt_format``) and prompt texts with ``prompt_format``; False never uses it.

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
    settings = FieldSettings(format, prompt_field, messages_field, answer_field)
    formatters = {conversation: PromptFormatter(tokenizer, conversation if use_chat_template is None
                                                else use_chat_template, prompt_format, tools)
                  for conversation in (False, True)}
    records: list[PromptRecord] = []
    for path in paths:
        layout = None
        for item in layout_rows(path, settings, one_turn=not formatters[True].uses_chat_template):
            if item.layout is not None and layout is None:
                layout = item.layout
                _check_template(layout, formatters[True], use_chat_template, path)
                logger.debug("%s: %s", path, layout.describe())
            error, text, ids = item.error, "", []
            if error is None:
                try:
                    text, ids = formatters[layout.conversation](field_value(item.row, layout.prompt_field))
                except ChatFormatError as bad:
                    error = f"{layout.prompt_field}: {bad}"
            if error is None and len(ids) > prompt_length:
                error = f"prompt has {len(ids)} tokens, more than prompt_length={prompt_length}"
            if error is not None:
                bad_rows.reject(item.location, error)
                continue
            records.append(_record(item.row, layout, text, ids, item.location))
    bad_rows.finish(len(records), ", ".join(map(str, paths)))
    return PromptDataset(records=records, skipped=bad_rows.skipped)


def _check_template(layout: RowLayout, formatter: PromptFormatter, use_chat_template: bool | None, path) -> None:
    """A conversation file with ``use_chat_template=True`` needs a tokenizer that has a chat template."""
    if layout.conversation and use_chat_template and not formatter.uses_chat_template:
        raise ValueError(f"{path}: {layout.describe()}: conversations are rendered with the tokenizer's chat "
                         "template, and the tokenizer has none (or the chat template is off)")


def _record(row: dict, layout: RowLayout, text: str, ids: list[int], location: str) -> PromptRecord:
    """The record of a checked row: the answer as text, the row's other top-level columns in ``extra`` (a nested
    answer's column, e.g. verl's ``reward_model``, stays there whole)."""
    prompt = field_value(row, layout.prompt_field)
    answer = None if layout.answer_field is None else str(field_value(row, layout.answer_field))
    extra = {k: v for k, v in row.items() if k not in (layout.prompt_field, layout.answer_field)}
    raw = prompt[-1]["content"] if layout.conversation else prompt
    return PromptRecord(text, ids, answer, raw, location, extra)


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
