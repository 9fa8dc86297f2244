"""Fields of a data row named by dotted paths: ``answer`` (a top-level column) or ``reward_model.ground_truth``
(the ``ground_truth`` key of the ``reward_model`` object, as verl's parquet files nest the answer).

A key that itself contains a dot is found first (``{"a.b": 1}`` has the field ``a.b``); otherwise the path is
followed one object at a time. A path that does not lead to a value raises :class:`FieldError`, whose message says
where it broke and which fields were there, so the fix is one override away.
"""

from __future__ import annotations

from typing import Any


class FieldError(KeyError):
    """A dotted field path that leads to no value in a row; ``str(error)`` is the readable reason."""

    def __str__(self) -> str:
        return str(self.args[0])


def field_value(row: dict, path: str) -> Any:
    """The value at ``path`` in ``row`` (a dict); FieldError naming the part of the path that is missing."""
    if path in row:
        return row[path]
    parts = path.split(".")
    value: Any = row
    for depth, part in enumerate(parts):
        walked = ".".join(parts[:depth])
        if not isinstance(value, dict):
            raise FieldError(f"{walked!r} is a {type(value).__name__}, not an object, so it has no field {part!r}")
        if part not in value:
            where = f"{walked!r} has the fields" if depth else "the row has the fields"
            raise FieldError(f"no field {path!r}: {where} {sorted(value)}")
        value = value[part]
    return value


def has_field(row: Any, path: str) -> bool:
    """Whether ``path`` leads to a value (None counts as present) in ``row``."""
    if not isinstance(row, dict):
        return False
    try:
        field_value(row, path)
    except FieldError:
        return False
    return True

