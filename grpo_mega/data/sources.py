"""Where a dataset's rows come from: what ``data.train_file`` / ``data.eval_file`` may name, and the rows read from it.

A path is one of:

- a ``.jsonl`` file (one JSON object a line) or a ``.parquet`` file;
- a folder of such shards (``train-00000-of-00004.parquet``, ...): its ``.jsonl`` or ``.parquet`` files, read in
  name order; a folder whose shards belong to several splits (``train-*`` beside ``test-*``) or that misses a shard
  of an ``-of-N`` set is refused, naming the split to choose (``data.train_file=FOLDER/train-*.parquet``);
- a glob of shards (``data/train-*.parquet``), read in name order;
- a Hugging Face ``datasets`` folder written by ``save_to_disk`` (``state.json``, ``dataset_info.json`` and
  ``data-0000i-of-0000N.arrow`` files in Arrow's IPC stream format), read with pyarrow alone; a ``DatasetDict``'s
  folder (``dataset_dict.json``) names its splits, one of which is the path to give.

Rows come out as ``(location, row, error)``: ``location`` names the file the row is in and its place there
(``shard.jsonl:LINE``, ``shard.parquet:row N``, ``data-00000-of-00001.arrow:row N``), ``error`` is a parse error
(invalid JSON) or None.
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

FILE_KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
"""Suffixes of the files rows are read from, and how each is read."""
TABLE_BATCH_ROWS = 1024
"""Rows per record batch read from a parquet or Arrow file."""
_SHARD_NAME = re.compile(r"^(?P<split>.*?)-(?P<index>\d+)-of-(?P<count>\d+)$")
_GLOB_CHARS = set("*?[")

Row = tuple[str, Any, "str | None"]


class DataSourceError(ValueError):
    """A data path that names no readable rows (no such file, an unknown suffix, a folder without shards or with
    several splits); the message says what to give instead."""


@dataclass(frozen=True)
class DataSource:
    """The files a data path names, in the order their rows are read."""

    path: str
    """The path as given."""
    files: tuple[Path, ...]
    """The files holding the rows, in reading order."""
    kind: str
    """What the path is: ``file``, ``folder`` (shards), ``glob`` or ``save_to_disk``."""

    def describe(self) -> str:
        """``"4 parquet shards"``-style summary for log lines."""
        if self.kind == "file":
            return f"{FILE_KINDS[self.files[0].suffix]} file"
        kinds = sorted({FILE_KINDS[f.suffix] for f in self.files})
        what = "a save_to_disk folder of" if self.kind == "save_to_disk" else f"{self.kind} of"
        return f"{what} {len(self.files)} {'/'.join(kinds)} file{'s' if len(self.files) > 1 else ''}"


def resolve_source(path: str | Path) -> DataSource:
    """The files ``path`` names (a file, a folder of shards, a glob, a save_to_disk folder); FileNotFoundError when
    it does not exist, DataSourceError with the reason when it names no readable rows."""
    text = str(path)
    path = Path(path)
    if path.is_file():
        _check_suffix(path, path)
        return DataSource(text, (path,), "file")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            raise DataSourceError(_dataset_dict_message(path))
        if (path / "state.json").is_file():
            return DataSource(text, _saved_dataset_files(path), "save_to_disk")
        return DataSource(text, _shards(path, sorted(p for p in path.iterdir() if p.is_file()), str(path)), "folder")
    if _GLOB_CHARS & set(text):
        matches = sorted(Path(match) for match in glob.glob(text) if Path(match).is_file())
        if not matches:
            raise DataSourceError(f"{text}: no file matches this pattern")
        for match in matches:
            _check_suffix(match, text)
        return DataSource(text, _shards(path.parent, matches, text), "glob")
    raise FileNotFoundError(f"{text}: no such file or folder")


def read_rows(path: str | Path) -> Iterator[Row]:
    """Rows of every file ``path`` names (``resolve_source``) as (location, row, parse error or None), in order.
    Raises at once, not on iteration, when ``path`` names no readable files: FileNotFoundError when it does not
    exist, else DataSourceError."""
    source = resolve_source(path)
    return _rows_of(source)


def _rows_of(source: DataSource) -> Iterator[Row]:
    for file in source.files:
        kind = FILE_KINDS[file.suffix]
        yield from (_rows_from_jsonl(file) if kind == "jsonl" else _rows_from_table(file, kind))


def _check_suffix(file: Path, given: str | Path) -> None:
    if file.suffix not in FILE_KINDS:
        raise DataSourceError(f"{given}: unsupported suffix {file.suffix!r} of {file.name}; expected .jsonl or "
                              ".parquet (or a folder of them, or a datasets save_to_disk folder)")


def _shards(folder: Path, files: list[Path], given: str) -> tuple[Path, ...]:
    """The data files among ``files`` (one kind, one split, no ``-of-N`` shard missing), in name order."""
    shards = [f for f in files if f.suffix in (".jsonl", ".parquet")]
    if not shards:
        inside = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())[:12] if folder.is_dir() else []
        hint = next((f"; the shards may be in {folder / p.rstrip('/')}" for p in inside
                     if p.endswith("/") and any((folder / p).glob("*.parquet"))), "")
        raise DataSourceError(f"{given}: no .jsonl or .parquet files in this folder (it holds {inside}){hint}")
    kinds = sorted({f.suffix for f in shards})
    if len(kinds) > 1:
        raise DataSourceError(f"{given}: holds both {' and '.join(kinds)} files; name one kind, e.g. "
                              f"{folder / ('*' + kinds[-1])}")
    splits: dict[str, list[tuple[int, int]]] = {}
    for shard in shards:
        match = _SHARD_NAME.match(shard.stem)
        if match:
            splits.setdefault(match["split"], []).append((int(match["index"]), int(match["count"])))
    if len(splits) > 1:
        first = "train" if "train" in splits else sorted(splits)[0]
        raise DataSourceError(f"{given}: holds the shards of several splits ({', '.join(sorted(splits))}); name one, "
                              f"e.g. {folder / (first + '-*' + kinds[0])}")
    for split, numbers in splits.items():
        counts = {count for _, count in numbers}
        missing = sorted(set(range(max(counts))) - {index for index, _ in numbers})
        if len(counts) == 1 and missing:
            names = ", ".join(f"{split}-{i:05d}-of-{max(counts):05d}" for i in missing[:3])
            raise DataSourceError(f"{given}: {len(numbers)} of the {max(counts)} shards of {split!r} are here; "
                                  f"missing {names}{' ...' if len(missing) > 3 else ''}")
    return tuple(shards)


def _saved_dataset_files(folder: Path) -> tuple[Path, ...]:
    """The arrow files of a ``Dataset.save_to_disk`` folder, in the order its ``state.json`` lists them."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise DataSourceError(f"{folder}/state.json is not a datasets save_to_disk state ({error!r:.80}): expected "
                              '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}, ...]}') from None
    files = tuple(folder / name for name in names)
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise DataSourceError(f"{folder}: state.json lists the data files {names}, of which {missing or 'none'} "
                              f"{'are' if len(missing) != 1 else 'is'} missing")
    for file in files:
        _check_suffix(file, folder)
    return files


def _dataset_dict_message(folder: Path) -> str:
    try:
        splits = list(json.loads((folder / "dataset_dict.json").read_text())["splits"])
    except (json.JSONDecodeError, KeyError, TypeError):
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
    example = folder / ("train" if "train" in splits or not splits else splits[0])
    return (f"{folder}: a DatasetDict saved with save_to_disk (splits {splits}); name one split's folder, e.g. "
            f"{example}")


def _rows_from_jsonl(path: Path) -> Iterator[Row]:
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


def _rows_from_table(path: Path, kind: str) -> Iterator[Row]:
    """(location, row, None) for every row of a parquet file or an Arrow IPC file (save_to_disk's stream format, or
    the random-access file format), read a record batch at a time (a reader that stops after a few rows, such as a
    config check, reads no more of a large file than it needs); needs pyarrow."""
    try:
        import pyarrow
        import pyarrow.ipc as ipc
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from error
    try:
        if kind == "parquet":
            yield from _numbered_rows(path, parquet.ParquetFile(path).iter_batches(batch_size=TABLE_BATCH_ROWS))
            return
        with pyarrow.memory_map(str(path)) as stream:
            try:
                batches = iter(ipc.open_stream(stream))
            except pyarrow.ArrowInvalid:
                reader = ipc.open_file(stream)
                batches = (reader.get_batch(index) for index in range(reader.num_record_batches))
            yield from _numbered_rows(path, batches)
    except pyarrow.ArrowException as error:  # not a parquet / Arrow file, or a damaged one
        raise DataSourceError(f"{path}: not a readable {kind} file ({error})") from None


def _numbered_rows(path: Path, batches) -> Iterator[Row]:
    """(location, row, None) for every row of ``batches`` (pyarrow record batches), numbered from 1 across them."""
    row_number = 0
    for batch in batches:
        for row in batch.to_pylist():
            row_number += 1
            yield f"{path}:row {row_number}", row, None
