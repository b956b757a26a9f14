"""Where a map's results go: a JSONL file appended in whole lines (or, for a Parquet output,
its journal: `parquet.py`); what an earlier, interrupted run left; how a row becomes a line.

Durability: every chunk of result rows is one `write` of whole lines, then `flush` and
`fsync`, so a kill (SIGKILL, power cut) leaves at most one partial last line, which the
next run with `resume=True` cuts off before appending. The rows already there are read
back by their key (the id column, or the row index), so the resumed run skips them and the
file ends with each row exactly once, whatever order its lines are in. With
`retry_errors`, the lines of rows that failed are first taken out of the file (rewritten
beside it, then renamed over it), so those rows run again and still appear once. Nothing
here runs programs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from lmprog.datasets.sources import require_pyarrow

OUTPUT_SUFFIXES = (".jsonl", ".parquet")
ERROR_COLUMN = "error"  # a result row's error: None, or what ended the row


def row_key(value: Any) -> str:
    """A row's identity as stored: its id (or index) in JSON, so 3 and "3" differ (and a
    numpy integer is its int, as the file holds it)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=to_jsonable)


class EncodedRow(NamedTuple):
    line: bytes  # one JSONL line, with its newline
    problem: str | None  # what had to be replaced to write the row (None: nothing)


def encode_row(row: dict[str, Any], default: Callable[[Any], Any] | None = None) -> EncodedRow:
    """One JSONL line. A value JSON has no type for is written as `default(value)` (its
    `str()` by default). NaN and infinities are written as null (JSON has no such numbers).
    A row that still cannot be written as it is (a string with a lone surrogate, a dict key
    that is no str / int / float / bool / None, a list holding itself) is written with those
    parts replaced (U+FFFD, the key's `str()`, null), and `problem` says what was replaced."""
    default = default or to_jsonable
    try:
        text = json.dumps(row, ensure_ascii=False, allow_nan=False, default=default)
        return EncodedRow((text + "\n").encode("utf-8"), None)
    except Exception:  # noqa: BLE001 - written below, part by part
        pass
    problems: set[str] = set()
    text = json.dumps(_writable(row, problems, set(), default), ensure_ascii=False)
    problem = (
        "ValueError: the row cannot be written as JSON as it is: " + "; ".join(sorted(problems))
        if problems
        else None  # (only NaN / infinities: written as null, not an error)
    )
    return EncodedRow((text + "\n").encode("utf-8"), problem)


def to_jsonable(value: Any) -> Any:
    """A value JSON has no type for: a numpy value's Python one, a set's list, or its str()."""
    if hasattr(value, "tolist"):  # numpy
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def _writable(value: Any, problems: set[str], active: set[int], default: Any) -> Any:
    """`value` as JSON can hold it; each kind of part replaced is noted in `problems`.
    `active`: the ids of the containers being walked (a container inside itself)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            problems.add("a string with a lone surrogate (written with U+FFFD)")
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if id(value) in active:
            problems.add("a container that holds itself (written as null)")
            return None
        active.add(id(value))
        try:
            if isinstance(value, dict):
                return {
                    _writable_key(k, problems, active, default): _writable(
                        v, problems, active, default
                    )
                    for k, v in value.items()
                }
            return [_writable(v, problems, active, default) for v in value]
        finally:
            active.discard(id(value))
    try:
        converted = default(value)
    except Exception as error:  # noqa: BLE001 - a value whose conversion raised
        problems.add(f"a {type(value).__name__} that could not be converted: {error!r}")
        return None
    return _writable(converted, problems, active, default)


def _writable_key(key: Any, problems: set[str], active: set[int], default: Any) -> Any:
    if hasattr(key, "tolist"):  # a numpy scalar
        key = key.tolist()
    if isinstance(key, str):
        return _writable(key, problems, active, default)
    if key is None or isinstance(key, (bool, int)):
        return key
    if isinstance(key, float) and math.isfinite(key):
        return key
    problems.add(f"a dict key of type {type(key).__name__} (written as its str())")
    return _writable(str(key), problems, active, default)


def check_output(output: str | os.PathLike[str], resume: bool) -> Path:
    """The output path, validated before anything runs (ValueError naming `output`)."""
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(f"output must be a path, got {type(output).__name__}")
    path = Path(output)
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ValueError(f"output {str(path)!r} must end in one of {OUTPUT_SUFFIXES}")
    if path.is_dir():
        raise ValueError(f"output {str(path)!r} is a directory")
    if is_parquet(path):
        require_pyarrow(f"output {str(path)!r}")
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


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() == ".parquet"  # (x.PARQUET too, as `check_output` takes it)


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal.jsonl") if is_parquet(path) else path


class JsonlSink:
    """Appends result lines to a JSONL file; `done` holds the keys of the rows already in it.

    The file is created at once (a path that cannot be written fails before a row runs);
    one this sink created is removed again by a `close` before any line was written and
    before the map completed (a bad id or input row at the start), so the same command
    runs again without `resume`. A file that existed before is never removed."""

    def __init__(self, path: Path, key_column: str, retry_errors: bool = False) -> None:
        self.path = path
        self.key_column = key_column
        self.done: set[str] = set()
        self.failed: set[str] = set()  # of `done`, the keys whose line holds an error
        if path.exists():
            self.done, self.failed = _read_keys(path, key_column, self.decode_line, retry_errors)
        self._is_new = not path.exists()
        self._has_lines = False  # a write of this sink has succeeded
        self._file = path.open("ab", buffering=0)  # (no buffer may hold a failed write)
        if self._is_new:  # the new directory entry must survive a power cut too
            fsync_dir(path.parent)

    def encode(self, row: dict[str, Any]) -> EncodedRow:
        return encode_row(row)

    def decode_line(self, line: bytes) -> Any:
        return json.loads(line)

    def write(self, lines: list[bytes]) -> None:
        """Append `lines` (from `encode`) as one write, durable when this returns. A write
        that fails (a full disk) is cut off again: the file holds whole lines only, and a
        retry or a resumed run goes on from them (a partial one was followed by the retry's
        whole lines, and a resume refused the file)."""
        if not lines:
            return
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            data = memoryview(b"".join(lines))
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):  # (else a resume cuts the partial line)
                os.ftruncate(fd, start)
            raise
        self._has_lines = True

    def close(self, is_complete: bool) -> None:
        """Close the file; an incomplete map's file that this sink created and wrote no line
        to is removed (an empty file would make the next run ask for `resume`)."""
        self._file.close()
        if not is_complete and self._is_new and not self._has_lines:
            with contextlib.suppress(OSError):  # (the error that stopped the map comes first)
                self.path.unlink()
                fsync_dir(self.path.parent)


def open_sink(path: Path, key_column: str, retry_errors: bool = False) -> JsonlSink:
    if is_parquet(path):
        from lmprog.datasets.parquet import ParquetSink

        return ParquetSink(path, key_column, retry_errors)
    return JsonlSink(path, key_column, retry_errors)


def _read_keys(
    path: Path, key_column: str, decode: Callable[[bytes], Any], retry_errors: bool
) -> tuple[set[str], set[str]]:
    """The keys of the complete lines (with `retry_errors`, of those without an error,
    the others taken out of the file), and of those the keys whose line holds an error; a
    partial last line (a write cut by a kill) is cut off the file here, before anything is
    appended."""
    keys: set[str] = set()
    failed_keys: set[str] = set()
    good_len = 0
    failed = 0
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # the last line, cut short
            try:
                row = decode(line)
            except json.JSONDecodeError:
                raise ValueError(
                    f"{path}:{line_no}: not a result row (a file lmprog did not write?)"
                ) from None
            if not isinstance(row, dict) or key_column not in row:
                raise ValueError(f"{path}:{line_no}: result row without {key_column!r}")
            good_len += len(line)
            has_error = row.get(ERROR_COLUMN) is not None
            if retry_errors and has_error:
                failed += 1
                continue
            key = row_key(row[key_column])
            keys.add(key)
            if has_error:
                failed_keys.add(key)
    if path.stat().st_size != good_len:
        with path.open("r+b") as f:
            f.truncate(good_len)
            f.flush()
            os.fsync(f.fileno())
    if failed:
        _drop_failed_lines(path, decode)
    return keys, failed_keys


def _drop_failed_lines(path: Path, decode: Callable[[bytes], Any]) -> None:
    """Rewrite `path` (whole lines only) without the rows that hold an error: written
    beside it and renamed over it, so a kill meanwhile leaves the file as it was. A
    symlinked output's target is rewritten, with its permissions; a rewrite that fails (a
    full disk) leaves no partial copy."""
    target = path.resolve()
    tmp = target.with_name(target.name + ".retry.tmp")
    try:
        with target.open("rb") as source, tmp.open("wb") as kept:
            for line in source:
                if decode(line).get(ERROR_COLUMN) is None:
                    kept.write(line)
            kept.flush()
            os.fsync(kept.fileno())
        shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
