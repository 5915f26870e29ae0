"""Parquet and Arrow corpora for the tools (FineWeb, hub datasets, `datasets` folders), read with pyarrow
(an optional extra) a record batch at a time, never whole.

    check_columns("fineweb/000_00000.parquet", "parquet", ["text"])          # InputError if unusable
    for record in read_records("fineweb/000_00000.parquet", "parquet", ["text"]): ...   # {"text": ...} per row

A record is the dict a JSON Lines document would be, holding the chosen columns, so the tools treat
both alike. Columns must hold text (strings, or lists of strings: pre-split documents); a missing or
non-text column, a file without rows and corrupt or truncated data raise InputError naming the file
and the fix.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Optional

from megalysses.data.text_input import InputError, Position

BATCH_ROWS = 1024
_NAMES = {"parquet": "Parquet", "arrow": "Arrow"}


def _pyarrow(path: str, kind: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise InputError(f"{path}: reading {_NAMES[kind]} data needs pyarrow: pip install pyarrow (or pip install "
                         f"'megalysses[arrow]')") from None
    return pyarrow


class _Table:
    """An open Parquet file, Arrow IPC file or Arrow IPC stream: its schema and record batches."""

    def __init__(self, path: str, kind: str, pa: Any) -> None:
        self.path, self.kind, self.pa = path, kind, pa
        self.source = pa.memory_map(path)
        if kind == "parquet":
            self.file = pa.parquet.ParquetFile(self.source)
            self.schema = self.file.schema_arrow
        else:
            self.stream = self.source.read(6) != b"ARROW1"
            self.source.seek(0)
            self.file = (pa.ipc.open_stream if self.stream else pa.ipc.open_file)(self.source)
            self.schema = self.file.schema

    def has_rows(self) -> bool:
        if self.kind == "parquet":
            return self.file.metadata.num_rows > 0
        if self.stream:
            return any(batch.num_rows for batch in self.file)
        return any(self.file.get_batch(i).num_rows for i in range(self.file.num_record_batches))

    def batches(self, columns: list[str]) -> Iterator[tuple[Any, float]]:
        """(record batch holding `columns`, the fraction of the file read after it)."""
        if self.kind == "parquet":
            rows, done = max(self.file.metadata.num_rows, 1), 0
            for batch in self.file.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                done += batch.num_rows
                yield batch, done / rows
        elif self.stream:
            size = max(self.source.size(), 1)
            for batch in self.file:
                yield batch, self.source.tell() / size
        else:
            n = self.file.num_record_batches
            for i in range(n):
                yield self.file.get_batch(i), (i + 1) / n


def _is_text(pa: Any, t: Any) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)


def _errors(pa: Any) -> tuple:
    """What pyarrow raises for unreadable data: its own exceptions, and OSError for what it reads."""
    return (pa.ArrowException, OSError)


def _corrupt(path: str, kind: str, err: Exception, rows: Optional[int] = None) -> str:
    after = f" after {rows} rows" if rows is not None else ""
    return (f"{path}: corrupt or truncated {_NAMES[kind]} data{after} ({' '.join(str(err).split())[:200]}): "
            f"re-download or re-create the file")


def _open(path: str, kind: str) -> _Table:
    pa = _pyarrow(path, kind)
    try:
        return _Table(path, kind, pa)
    except _errors(pa) as err:
        raise InputError(_corrupt(path, kind, err)) from None


def check_columns(path: str, kind: str, keys: list[str], flag: str = "--json-keys") -> None:
    """Open the file and check that every key is a text column and that it has rows; raises InputError
    for a file the tools cannot use (naming `flag`, the option that chooses the columns)."""
    table = _open(path, kind)
    names = table.schema.names
    text = [f.name for f in table.schema if _is_text(table.pa, f.type)]
    for key in keys:
        if key not in names:
            raise InputError(f"{path}: no column '{key}' (its text columns: {', '.join(text) or 'none'}): pass one "
                             f"with {flag}")
        kind_of = table.schema.field(key).type
        if not _is_text(table.pa, kind_of):
            raise InputError(f"{path}: column '{key}' holds {kind_of}, not text (its text columns: "
                             f"{', '.join(text) or 'none'}): pass a text column with {flag}")
    _require_rows(table, path, kind)


def _require_rows(table: "_Table", path: str, kind: str) -> None:
    """InputError for a file without rows, or one whose rows cannot be read."""
    try:
        empty = not table.has_rows()
    except _errors(table.pa) as err:
        raise InputError(_corrupt(path, kind, err)) from None
    if empty:
        raise InputError(f"{path}: the {_NAMES[kind]} file holds no rows: nothing to read; remove it from --input")


CHAT_SHAPES = (("messages",), ("prompt", "completion"))


def chat_columns(path: str, kind: str) -> list[str]:
    """The columns of a file of conversations: messages, or prompt and completion, and tools where it has them;
    InputError for a file with neither shape, or without rows."""
    table = _open(path, kind)
    names = table.schema.names
    shape = next((list(s) for s in CHAT_SHAPES if all(c in names for c in s)), None)
    if shape is None:
        raise InputError(f"{path}: no 'messages' column, nor 'prompt' and 'completion' (its columns: "
                         f"{', '.join(names) or 'none'}): --chat reads conversations in one of these shapes")
    _require_rows(table, path, kind)
    return shape + (["tools"] if "tools" in names else [])


def read_records(path: str, kind: str, keys: list[str], position: Optional[Position] = None) -> Iterator[dict]:
    """Per row, {key: value} for the key columns (values as JSON would give them: str, list of str, None)."""
    table = _open(path, kind)
    base = position.done if position else 0
    size = os.path.getsize(path)
    rows = 0
    try:
        for batch, fraction in table.batches(keys):
            values = [batch.column(k).to_pylist() for k in keys]
            if position:
                position.done = base + int(fraction * size)
            for row in zip(*values):
                rows += 1
                yield dict(zip(keys, row))
    except _errors(table.pa) as err:
        raise InputError(_corrupt(path, kind, err, rows)) from None
    if position:
        position.done = base + size
