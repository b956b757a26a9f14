"""Where a map's rows come from: lists of dicts, pandas DataFrames, Hugging Face datasets,
and JSONL / CSV / Parquet files, read in chunks so memory stays flat in the number of rows.

A `RowSource` yields plain dicts of Python values (numpy scalars and arrays converted), and
says what it knows up front: its columns (None for JSONL and lists, whose rows may differ)
and its number of rows (None when only reading it all would tell). pandas, pyarrow and
datasets are imported only when such an input is given. Nothing here knows about programs.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

_PYARROW_HINT = "pip install pyarrow, or lmprog's `data` extra: pip install '.[data]'"

FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")
CHUNK_ROWS = 1024  # rows converted at a time from a DataFrame, a dataset or a Parquet file


class RowSource:
    """Rows as dicts, with the columns and row count when they are known before reading."""

    def __init__(
        self,
        rows: Iterable[dict[str, Any]],
        *,
        columns: list[str] | None = None,
        num_rows: int | None = None,
        name: str = "data",
    ) -> None:
        self._rows = rows
        self.columns = columns
        self.num_rows = num_rows
        self.name = name

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._rows)


def open_source(data: Any) -> RowSource:
    """A `RowSource` over `data`; TypeError / ValueError (naming `data`) when it is not one
    of the supported kinds, and FileNotFoundError for a missing file."""
    if isinstance(data, RowSource):
        return data
    if isinstance(data, (str, os.PathLike)):
        return _file_source(Path(data))
    module = type(data).__module__.split(".")[0]
    if module == "pandas" and type(data).__name__ == "DataFrame":
        return _dataframe_source(data)
    if module == "datasets":
        return _hf_source(data)
    if isinstance(data, Mapping):
        raise TypeError("data must be rows (a list of dicts), not one dict")
    if isinstance(data, (list, tuple)):
        for i, row in enumerate(data):
            if not isinstance(row, Mapping):
                raise TypeError(f"data[{i}] must be a dict of columns, got {type(row).__name__}")
        return RowSource((dict(r) for r in data), num_rows=len(data))
    if isinstance(data, Iterable) and not isinstance(data, (bytes, bytearray)):
        return RowSource(_checked_rows(data))
    raise TypeError(
        "data must be a list (or iterable) of dicts, a pandas DataFrame, a Hugging Face "
        f"datasets.Dataset or a path to a {'/'.join(FILE_SUFFIXES)} file; "
        f"got {type(data).__name__}"
    )


def native(value: Any) -> Any:
    """`value` with numpy scalars and arrays (as pandas, Ray and pyarrow hand them out)
    turned into Python ones, so rows compare and serialize as plain data."""
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":
        return native(value.tolist())
    if isinstance(value, list):
        return [native(v) for v in value]
    if isinstance(value, dict):
        return {k: native(v) for k, v in value.items()}
    return value


def _checked_rows(rows: Iterable[Any]) -> Iterator[dict[str, Any]]:
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"row {i} of data must be a dict of columns, got {type(row).__name__}")
        yield dict(row)


def _file_source(path: Path) -> RowSource:
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ValueError(f"data path {str(path)!r} must end in one of {FILE_SUFFIXES}")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if suffix == ".jsonl":
        return RowSource(_jsonl_rows(path), num_rows=count_lines(path), name=str(path))
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as f:
            try:
                header = next(csv.reader(f), [])
            except UnicodeDecodeError as error:
                raise decode_error(path, error) from None
        return RowSource(
            _csv_rows(path), columns=header, num_rows=_count_csv_rows(path), name=str(path)
        )
    require_pyarrow(f"input {str(path)!r}")
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path)
    return RowSource(
        _parquet_rows(path),
        columns=list(meta.schema_arrow.names),
        num_rows=meta.metadata.num_rows,
        name=str(path),
    )


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8-sig") as f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({error})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{line_no}: a row must be a JSON object")
                yield row
        except UnicodeDecodeError as error:
            raise decode_error(path, error) from None


def count_lines(path: Path) -> int:
    """The rows of a JSONL file (or of a `.txt` one, a line each), for the progress bar's
    total: its lines as `_jsonl_rows` reads them (the same decoding, line ends and strip:
    a line holding only U+00A0, or only a byte order mark, is no row), without parsing."""
    with path.open(encoding="utf-8-sig", errors="replace") as f:
        return sum(1 for line in f if line.strip())


def _count_csv_rows(path: Path) -> int | None:
    """The rows of a CSV file, for the progress bar's total, as `_csv_rows` reads them (a
    blank line is none); None where the file cannot be read as CSV (reading it says why)."""
    with path.open(newline="", encoding="utf-8-sig", errors="replace") as f:
        try:
            return max(sum(1 for row in csv.reader(f) if row) - 1, 0)
        except csv.Error:
            return None


def decode_error(path: Path, error: UnicodeDecodeError) -> ValueError:
    """A text file's bytes that are not UTF-8, said with the file and line (a text reader's
    own error only gives the byte's place in the chunk it was decoding)."""
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if line_no == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8) :]
            try:
                line.decode("utf-8")  # (0x0A is in no multi-byte character: lines decode alone)
            except UnicodeDecodeError as bad:
                return ValueError(
                    f"{path}:{line_no}: not UTF-8 text: byte 0x{line[bad.start]:02x} at byte "
                    f"{bad.start + 1} of the line ({bad.reason}); save the file as UTF-8"
                )
    return ValueError(f"{path}: not UTF-8 text ({error})")


def _csv_rows(path: Path) -> Iterator[dict[str, Any]]:
    """CSV values are strings, as written; a missing trailing cell is an empty string, and
    a cell past the header's last column is an error of the file (it has no column name)."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, restval="")
        try:
            for row in reader:
                if None in row:  # (where DictReader puts the cells past the header)
                    num_columns = len(reader.fieldnames)
                    raise ValueError(
                        f"{path}:{reader.line_num}: {num_columns + len(row[None])} cells, but "
                        f"the header names {num_columns} columns"
                    )
                yield row
        except UnicodeDecodeError as error:
            raise decode_error(path, error) from None


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=CHUNK_ROWS):
        yield from batch.to_pylist()


def _dataframe_source(df: Any) -> RowSource:
    columns = [str(c) for c in df.columns]
    if len(set(columns)) != len(columns):
        raise ValueError(f"data (a DataFrame) has duplicate column names: {columns}")

    def rows() -> Iterator[dict[str, Any]]:
        for start in range(0, len(df), CHUNK_ROWS):
            chunk = df.iloc[start : start + CHUNK_ROWS]
            for record in chunk.to_dict("records"):
                yield {str(k): native(v) for k, v in record.items()}

    return RowSource(rows(), columns=columns, num_rows=len(df))


def _hf_source(ds: Any) -> RowSource:
    if not hasattr(ds, "iter") or not hasattr(ds, "column_names"):
        raise TypeError(f"data must be a datasets.Dataset or IterableDataset, got {type(ds)}")

    def rows() -> Iterator[dict[str, Any]]:
        for batch in ds.iter(batch_size=CHUNK_ROWS):
            names = list(batch)
            for values in zip(*(batch[n] for n in names)):
                yield {n: native(v) for n, v in zip(names, values)}

    num_rows = len(ds) if hasattr(ds, "__len__") else None
    return RowSource(rows(), columns=list(ds.column_names or []) or None, num_rows=num_rows)


def require_pyarrow(what: str) -> None:
    """ImportError where pyarrow is missing, said before anything runs (a Parquet output
    once failed only after every row had run)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ImportError(f"{what} is Parquet, which needs pyarrow: {_PYARROW_HINT}") from None
