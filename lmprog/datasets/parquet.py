"""A Parquet output: rows go to a JSONL journal as they finish; when every row is done the
journal becomes the Parquet file, each column of the Arrow type that holds its values as
they were, or JSON text.

A Parquet file cannot be appended to, so its rows go to `<output>.journal.jsonl` first (a
`JsonlSink`, with its durability); when every row is done the journal becomes the Parquet
file (written beside it, then renamed over it) and is removed. While the journal exists it
is the truth: a resumed run reads it, and an existing Parquet file is first copied into it.

The journal keeps what JSON has no type for as one-key objects (`{"$lmprog.bytes":
base64}`, and `datetime`, `date`, `time`, `decimal` as ISO / decimal text), so bytes stay
binary and timestamps, dates and decimals keep their Arrow types in the file. A column whose
values no one Arrow type holds exactly (1 and "1"; dicts with different keys, which a
struct would fill up with nulls; ints beyond 2**53 beside floats) is JSON text, every value
(strings too: 1 is `1`, "1" is `"1"`), and is named in the file's `JSON_COLUMNS_METADATA`,
so a resumed run reads the values back as they were (ids too).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmprog.datasets.sinks import (
    EncodedRow,
    JsonlSink,
    encode_row,
    fsync_dir,
    journal_path,
    to_jsonable,
)

CHUNK_ROWS = 4096  # rows per pass over the journal when building the Parquet file
JSON_COLUMNS_METADATA = b"lmprog.json_columns"  # a JSON list of the JSON text columns
# Written by earlier versions, for a key column of mixed types: each row's key (JSON).
KEYS_METADATA = b"lmprog.keys"
MAX_EXACT_INT = 2**53  # ints up to this are exact as float64

# The journal's one-key objects for values JSON has no type for: tag -> (type, decode).
_TAGGED: dict[str, tuple[type, Any]] = {
    "$lmprog.bytes": (bytes, base64.b64decode),
    "$lmprog.datetime": (datetime.datetime, lambda text: _from_iso(datetime.datetime, text)),
    "$lmprog.date": (datetime.date, datetime.date.fromisoformat),
    "$lmprog.time": (datetime.time, lambda text: _from_iso(datetime.time, text)),
    "$lmprog.decimal": (decimal.Decimal, decimal.Decimal),
}


def _from_iso(kind: Any, text: str) -> Any:
    """`kind.fromisoformat(text)`, fractions of a second cut to microseconds: a pandas
    Timestamp writes nanoseconds, which Python 3.10 refused (3.11 on cut them too)."""
    return kind.fromisoformat(re.sub(r"(\.[0-9]{6})[0-9]+", r"\1", text))


class ParquetSink(JsonlSink):
    """Rows go to the journal; `close(is_complete=True)` turns it into the Parquet file."""

    def __init__(self, path: Path, key_column: str, retry_errors: bool = False) -> None:
        self.output = path
        journal = journal_path(path)
        if path.exists() and not journal.exists():
            _parquet_to_journal(path, journal, key_column)
        super().__init__(journal, key_column, retry_errors)

    def encode(self, row: dict[str, Any]) -> EncodedRow:
        return encode_row(row, default=_journal_default)

    def decode_line(self, line: bytes) -> Any:
        return json.loads(line, object_hook=_journal_hook)

    def close(self, is_complete: bool) -> None:
        super().close(is_complete)
        if is_complete:
            _journal_to_parquet(self.path, self.output)
            self.path.unlink()


def _journal_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"$lmprog.bytes": base64.b64encode(value).decode("ascii")}
    for tag, (kind, _) in _TAGGED.items():
        if isinstance(value, kind):  # (a datetime is a date: datetime is tried first)
            if value != value:  # noqa: PLR0124 - missing: pandas' NaT, Decimal("NaN")
                return None
            return {tag: str(value) if kind is decimal.Decimal else value.isoformat()}
    return to_jsonable(value)


def _journal_hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1:
        ((tag, text),) = obj.items()
        if tag in _TAGGED and isinstance(text, str):
            return _TAGGED[tag][1](text)
    return obj


def _journal_rows(journal: Path) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    with journal.open("rb") as f:
        for line in f:
            chunk.append(json.loads(line, object_hook=_journal_hook))
            if len(chunk) == CHUNK_ROWS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _parquet_to_journal(parquet: Path, journal: Path, key_column: str) -> None:
    """Copy a finished Parquet output into a new journal (a resumed run appends to it),
    with the values of its JSON text columns as they were."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(parquet)
    metadata = file.schema_arrow.metadata or {}
    json_columns = json.loads(metadata.get(JSON_COLUMNS_METADATA, b"[]"))
    keys = iter(json.loads(metadata[KEYS_METADATA])) if KEYS_METADATA in metadata else None
    tmp = journal.with_name(journal.name + ".tmp")
    with tmp.open("wb") as f:
        for batch in file.iter_batches(batch_size=CHUNK_ROWS):
            rows = batch.to_pylist()
            for row in rows:
                for name in json_columns:
                    if row[name] is not None:
                        row[name] = json.loads(row[name], object_hook=_journal_hook)
                if keys is not None:
                    row[key_column] = json.loads(next(keys))
            f.write(b"".join(encode_row(r, default=_journal_default).line for r in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, journal)
    fsync_dir(journal.parent)


def _journal_to_parquet(journal: Path, output: Path) -> None:
    """Two passes over the journal, one chunk in memory at a time: the first settles each
    column's Arrow type (or JSON text), the second writes the chunks with it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    found: dict[str, set[Any]] = {}  # column -> the types of its chunks (None: no type)
    wide: set[str] = set()  # columns holding an int beyond MAX_EXACT_INT
    for chunk in _journal_rows(journal):
        for name in {k: None for row in chunk for k in row}:
            values = [r.get(name) for r in chunk]
            found.setdefault(name, set()).add(_exact_type(values))
            if any(type(v) is int and abs(v) > MAX_EXACT_INT for v in values):
                wide.add(name)
    types = {name: _settle_type(kinds, name in wide) for name, kinds in found.items()}
    json_columns = [name for name, t in types.items() if t is None]
    schema = pa.schema([(name, t or pa.string()) for name, t in types.items()])
    schema = schema.with_metadata({JSON_COLUMNS_METADATA: json.dumps(json_columns)})
    tmp = output.with_name(output.name + ".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for chunk in _journal_rows(journal):
            arrays = [_arrow_array([r.get(n) for r in chunk], t) for n, t in types.items()]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)
    fsync_dir(output.parent)


def column_array(values: list[Any]) -> Any:
    """`values` as one Arrow array Parquet can write: of the type that holds each value as
    it is, else JSON text (`lmprog.ray`'s batches, as this file's chunks)."""
    return _arrow_array(values, _exact_type(values))


def _exact_type(values: list[Any]) -> Any:
    """The type pyarrow infers for one chunk of a column, if it holds every value as it is
    (a struct fills a dict's missing keys with None: not exact) and Parquet can write it;
    else None."""
    import pyarrow as pa

    try:
        array = pa.array(values)
    except (pa.ArrowException, OverflowError, UnicodeError):
        return None
    if not _can_write(array.type) or array.to_pylist() != values:
        return None
    return array.type


def _can_write(arrow_type: Any) -> bool:
    """Parquet cannot write a struct without fields (a column of `{}`), at any depth."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        fields = [arrow_type.field(i).type for i in range(arrow_type.num_fields)]
        return bool(fields) and all(_can_write(t) for t in fields)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return _can_write(arrow_type.value_type)
    if pa.types.is_fixed_size_list(arrow_type):
        return _can_write(arrow_type.value_type)
    return True


def _settle_type(found: set[Any], has_wide_ints: bool) -> Any:
    """One type for a column: the only type its chunks had (ints and floats make floats,
    unless an int is beyond what a float holds exactly); else None: JSON text."""
    import pyarrow as pa

    found = {t for t in found if t is None or t != pa.null()}
    if not found:
        return pa.null()
    if found == {pa.int64(), pa.float64()} and not has_wide_ints:
        return pa.float64()
    return found.pop() if len(found) == 1 else None


def _arrow_array(values: list[Any], arrow_type: Any) -> Any:
    import pyarrow as pa

    if arrow_type is None:  # JSON text, every value (a string too: 1 and "1" differ)
        values = [
            None if v is None else json.dumps(v, ensure_ascii=False, default=_journal_default)
            for v in values
        ]
        arrow_type = pa.string()
    return pa.array(values, type=arrow_type)
