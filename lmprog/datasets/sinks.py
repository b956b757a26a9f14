"""Where a map's results go: a JSONL file appended in whole lines, or a Parquet file built
from such a journal when the run completes; and what an earlier, interrupted run left.

Durability: every chunk of result rows is one `write` of whole lines, then `flush` and
`fsync`, so a kill (SIGKILL, power cut) leaves at most one partial last line, which the
next run with `resume=True` cuts off before appending. The rows already there are read
back by their key (the id column, or the row index), so the resumed run skips them and the
file ends with each row exactly once. A Parquet output cannot be appended to, so its rows
go to `<output>.journal.jsonl` first; when every row is done the journal becomes the
Parquet file (written beside it, then renamed over it) and is removed. While the journal
exists it is the truth: a resumed run reads it, and an existing Parquet file is first
copied into it. Nothing here runs programs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUTPUT_SUFFIXES = (".jsonl", ".parquet")
PARQUET_CHUNK_ROWS = 4096  # rows per pass over the journal when building the Parquet file


# A Parquet output's metadata entry holding each row's key (JSON), where its key column
# mixes types and so holds them as strings (3 and "3" would read back the same).
KEYS_METADATA = b"lmprog.keys"


def row_key(value: Any) -> str:
    """A row's identity as stored: its id (or index) in JSON, so 3 and "3" differ (and a
    numpy integer is its int, as the file holds it)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=_jsonable)


def encode_row(row: dict[str, Any]) -> bytes:
    """One JSONL line; a value JSON cannot hold is written as its `str()`."""
    return (json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n").encode("utf-8")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def check_output(output: str | os.PathLike[str], resume: bool) -> Path:
    """The output path, validated before anything runs (ValueError naming `output`)."""
    path = Path(output)
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ValueError(f"output {str(path)!r} must end in one of {OUTPUT_SUFFIXES}")
    if path.is_dir():
        raise ValueError(f"output {str(path)!r} is a directory")
    parent = path.parent
    if not parent.is_dir():  # (said now, not once the model has loaded and rows ran)
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"output {str(path)!r}: its directory {str(parent)!r} {what}")
    if not resume:
        for existing in (path, journal_path(path)):
            if existing.exists():
                raise ValueError(
                    f"output {str(existing)!r} already exists: pass resume=True (CLI: "
                    "--resume) to skip the rows it holds, or remove it"
                )
    return path


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal.jsonl") if path.suffix == ".parquet" else path


class JsonlSink:
    """Appends result rows to a JSONL file; `done` holds the keys of the rows already in it."""

    def __init__(self, path: Path, key_column: str) -> None:
        self.path = path
        self.key_column = key_column
        self.done: set[str] = set()
        if path.exists():
            self.done = _read_keys(path, key_column)
        is_new = not path.exists()
        self._file = path.open("ab")
        if is_new:  # the new directory entry must survive a power cut too
            _fsync_dir(path.parent)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append `rows` as one write of whole lines, durable when this returns."""
        if not rows:
            return
        self._file.write(b"".join(encode_row(r) for r in rows))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, is_complete: bool) -> None:
        self._file.close()


class ParquetSink(JsonlSink):
    """Rows go to the journal; `close(is_complete=True)` turns it into the Parquet file."""

    def __init__(self, path: Path, key_column: str) -> None:
        self.output = path
        journal = journal_path(path)
        if path.exists() and not journal.exists():
            _parquet_to_journal(path, journal, key_column)
        super().__init__(journal, key_column)

    def close(self, is_complete: bool) -> None:
        super().close(is_complete)
        if is_complete:
            _journal_to_parquet(self.path, self.output, self.key_column)
            self.path.unlink()


def open_sink(path: Path, key_column: str) -> JsonlSink:
    return (
        ParquetSink(path, key_column) if path.suffix == ".parquet" else JsonlSink(path, key_column)
    )


def _read_keys(path: Path, key_column: str) -> set[str]:
    """The keys of the complete lines; a partial last line (a write cut by a kill) is cut
    off the file here, before anything is appended."""
    keys: set[str] = set()
    good_len = 0
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # the last line, cut short
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(
                    f"{path}:{line_no}: not a result row (a file lmprog did not write?)"
                ) from None
            if not isinstance(row, dict) or key_column not in row:
                raise ValueError(f"{path}:{line_no}: result row without {key_column!r}")
            keys.add(row_key(row[key_column]))
            good_len += len(line)
    if path.stat().st_size != good_len:
        with path.open("r+b") as f:
            f.truncate(good_len)
            f.flush()
            os.fsync(f.fileno())
    return keys


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _journal_rows(journal: Path) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    with journal.open("rb") as f:
        for line in f:
            chunk.append(json.loads(line))
            if len(chunk) == PARQUET_CHUNK_ROWS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _parquet_to_journal(parquet: Path, journal: Path, key_column: str) -> None:
    """Copy a finished Parquet output into a new journal (a resumed run appends to it),
    each row's key as it was (`KEYS_METADATA`)."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(parquet)
    metadata = file.schema_arrow.metadata or {}
    keys = iter(json.loads(metadata[KEYS_METADATA])) if KEYS_METADATA in metadata else None
    tmp = journal.with_name(journal.name + ".tmp")
    with tmp.open("wb") as f:
        for batch in file.iter_batches(batch_size=PARQUET_CHUNK_ROWS):
            rows = batch.to_pylist()
            for row in rows if keys is not None else ():
                row[key_column] = json.loads(next(keys))
            f.write(b"".join(encode_row(r) for r in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, journal)
    _fsync_dir(journal.parent)


def _journal_to_parquet(journal: Path, output: Path, key_column: str) -> None:
    """Two passes over the journal, one chunk in memory at a time: the first settles each
    column's Arrow type, the second writes the chunks with it. A key column of mixed types
    (ids 1 and "b": strings in the file) keeps its keys in the file's metadata too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, set[Any]] = {}
    for chunk in _journal_rows(journal):
        for name in {k: None for row in chunk for k in row}:
            columns.setdefault(name, set()).add(_arrow_type([r.get(name) for r in chunk]))
    types = {name: _settle_type(found) for name, found in columns.items()}
    schema = pa.schema([(name, t) for name, t in types.items()])
    if types.get(key_column) == pa.string() and columns[key_column] != {pa.string()}:
        keys = [row_key(r.get(key_column)) for chunk in _journal_rows(journal) for r in chunk]
        schema = schema.with_metadata({KEYS_METADATA: json.dumps(keys)})
    tmp = output.with_name(output.name + ".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for chunk in _journal_rows(journal):
            arrays = [_arrow_array([r.get(n) for r in chunk], types[n]) for n in types]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)
    _fsync_dir(output.parent)


def _arrow_type(values: list[Any]) -> Any:
    """The type pyarrow infers for one chunk of a column; None when it cannot hold it."""
    import pyarrow as pa

    try:
        return pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return None


def _settle_type(found: set[Any]) -> Any:
    """One type for a column: the only type its chunks had (ints and floats make floats);
    otherwise strings, each non-string value written as JSON."""
    import pyarrow as pa

    found = {t for t in found if t is None or t != pa.null()}
    if found == {pa.int64(), pa.float64()}:
        return pa.float64()
    if len(found) == 1 and None not in found:
        return found.pop()
    return pa.null() if not found else pa.string()


def _arrow_array(values: list[Any], arrow_type: Any) -> Any:
    import pyarrow as pa

    if arrow_type == pa.string():
        values = [
            v if v is None or isinstance(v, str) else json.dumps(v, default=_jsonable)
            for v in values
        ]
    return pa.array(values, type=arrow_type)
