"""`Function.map`: a program over a dataset, checked up front and run as it is iterated.

`map_program` validates everything it can see before any row runs (the data's kind and
columns, the output path, the options) and returns a `MapRun`: iterating it runs the rows
(`runner.py`) and yields result rows; `run()` drives it to the end without keeping them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from lmprog.datasets.ordering import program_params
from lmprog.datasets.progress import Progress
from lmprog.datasets.runner import MapOptions, iter_results, reserved_columns
from lmprog.datasets.sinks import check_output, open_sink
from lmprog.datasets.sources import open_source

if TYPE_CHECKING:
    from lmprog.function import Function

INDEX_COLUMN = "row_index"  # the row's input position, when rows have no id column
DEFAULT_WINDOW = 1024


class MapSummary(NamedTuple):
    num_rows: int  # rows run by this call
    num_errors: int  # of them, rows whose error column is set
    num_skipped: int  # input rows the output already held (resume), not run again
    seconds: float
    num_skipped_errors: int = 0  # of the skipped rows, those whose line holds an error


class MapRun:
    """The rows of a map, produced as they are iterated (once).

    Example:
        >>> for row in qa.map("questions.jsonl", temperature=0):  # doctest: +SKIP
        ...     print(row["question"], row["answer"], row["error"])
        >>> qa.map(df, output="answers.parquet", resume=True).run()  # doctest: +SKIP
    """

    def __init__(self, start: Any) -> None:
        self._start = start  # () -> (iterator of rows, Progress)
        self._is_started = False
        self._progress: Progress | None = None
        self._seconds = 0.0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._is_started:
            raise RuntimeError("a MapRun can be iterated once; call .map(...) again")
        self._is_started = True
        begin = time.monotonic()
        rows, self._progress = self._start()
        try:
            yield from rows
        finally:
            rows.close()
            self._seconds = time.monotonic() - begin

    def run(self) -> MapSummary:
        """Run every row (writing the output, if any) without keeping the rows."""
        for _ in self:
            pass
        return self.summary()

    def summary(self) -> MapSummary:
        progress = self._progress
        return MapSummary(
            progress.num_rows if progress else 0,
            progress.num_errors if progress else 0,
            progress.num_skipped if progress else 0,
            self._seconds,
            progress.num_skipped_errors if progress else 0,
        )


def map_program(
    fn: Function,
    data: Any,
    *,
    output: str | os.PathLike[str] | None = None,
    id_column: str | None = None,
    resume: bool = False,
    retry_errors: bool = False,
    ordered: bool = True,
    cache_aware: bool = True,
    include_text: bool = False,
    include_usage: bool = False,
    window: int = DEFAULT_WINDOW,
    num_threads: int | str = "auto",
    progress: bool = False,
    backend: Any = None,
    index_column: str | None = INDEX_COLUMN,
    **defaults: Any,
) -> MapRun:
    """See `Function.map`."""
    from lmprog.function import _resolve
    from lmprog.run_options import check_num_threads, split_kwargs

    run_defaults, extra = split_kwargs(defaults, fn.keyword_names)
    if extra:
        raise TypeError(
            f"map got unknown keyword arguments {sorted(extra)}; fix program arguments "
            "with .bind(...), or give them as columns"
        )
    for name, value in (
        ("resume", resume),
        ("retry_errors", retry_errors),
        ("ordered", ordered),
        ("cache_aware", cache_aware),
        ("include_text", include_text),
        ("include_usage", include_usage),
        ("progress", progress),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    num_threads = check_num_threads(num_threads)
    if id_column is not None and not isinstance(id_column, str):
        raise TypeError(f"id_column must be a column name (str), got {id_column!r}")
    if resume and output is None:
        raise ValueError("resume=True needs an output file to resume (output=...)")
    if retry_errors and not resume:
        raise ValueError("retry_errors=True runs failed rows of a resumed output: pass resume=True")
    if output is not None and id_column is None and index_column is None:
        raise ValueError("an output file needs id_column (or the row index) to resume by")
    path = check_output(output, resume) if output is not None else None
    source = open_source(data)
    opts = MapOptions(
        id_column=id_column,
        index_column=index_column,
        ordered=ordered,
        cache_aware=cache_aware,
        include_text=include_text,
        include_usage=include_usage,
        window=window,
        num_threads=num_threads,
        defaults=run_defaults,
    )
    _check_columns(fn, source.columns, opts.id_column, opts.reserved(), source.name)
    resolved = _resolve(backend)

    def start() -> tuple[Iterator[dict[str, Any]], Progress]:
        # (before the output is opened: a resume with retry_errors rewrites it at once)
        resolved.check_can_wait(f"{fn.func.__name__}'s map")
        key = id_column or index_column or ""
        sink = open_sink(path, key, retry_errors) if path is not None else None
        bar = Progress(enabled=progress, total=source.num_rows, desc=fn.__name__)
        return iter_results(fn, source, resolved, opts, sink, bar), bar

    return MapRun(start)


def check_data(
    fn: Function,
    data: Any,
    *,
    id_column: str | None = None,
    include_text: bool = False,
    include_usage: bool = False,
) -> None:
    """What `map` checks of `data` before a row runs (its kind, its file, its columns),
    without a backend: the CLI says it before the model loads."""
    source = open_source(data)
    reserved = reserved_columns(id_column, INDEX_COLUMN, include_text, include_usage)
    _check_columns(fn, source.columns, id_column, reserved, source.name)


def _check_columns(
    fn: Function,
    columns: list[str] | None,
    id_column: str | None,
    reserved: set[str],
    name: str,
) -> None:
    """Columns known before reading (tables, CSV, Parquet): every row would fail the same
    way, so say it now (ValueError naming the column)."""
    if columns is None:
        return
    if id_column is not None and id_column not in columns:
        raise ValueError(f"id_column {id_column!r} is not a column of {name}: {columns}")
    clash = reserved & set(columns)
    if clash:
        raise ValueError(
            f"{name} has column(s) {sorted(clash)}, which the output writes itself; rename them"
        )
    for p in program_params(fn):
        if p.name not in columns and p.default is p.empty:
            raise ValueError(
                f"{name} has no column {p.name!r} for the argument of {fn.__name__}(); "
                f"its columns are {columns}"
            )
