"""The map loop: rows in, one program per row on a bounded pool, result rows out.

Rows are read a window at a time; each window is sorted by prompt prefix (cache-aware
order) and its rows handed to `num_threads` threads, each running one program to its end
(as `run_batch` does). Results come out as rows finish, or in input order with `ordered`;
either way at most about two windows of rows are held at once, so memory stays flat in the
number of rows (the ids of an output file excepted). Rows are appended to the sink in
chunks (whole lines, fsync) in the order they come out. A row's failure (its program
raised, a request was refused, a column is missing, a value JSON cannot hold) is its
`error` column, never the map's; a map stopped early (the iterator closed, Ctrl-C, a bad
id) cancels the programs still running and writes the rows that had finished (with
`ordered`, those waiting for an earlier row too), so a resumed run redoes the rest.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from lmprog.backend import Backend
from lmprog.datasets.ordering import PrefixTemplate, program_params
from lmprog.datasets.progress import USAGE_COLUMNS, Progress, UsageBackend
from lmprog.datasets.sinks import JsonlSink, row_key
from lmprog.datasets.sources import RowSource
from lmprog.display import describe_error, free_name
from lmprog.state import ProgramState

if TYPE_CHECKING:
    from lmprog.function import Function

FLUSH_ROWS = 256  # a durable write once this many rows wait ...
FLUSH_S = 1.0  # ... or this many seconds after the last write


@dataclass(frozen=True)
class MapOptions:
    id_column: str | None  # the row's id; None: its input position, as `index_column`
    index_column: str | None  # where the input position goes (None: nowhere, e.g. Ray)
    ordered: bool
    cache_aware: bool
    include_text: bool
    include_usage: bool
    window: int
    num_threads: int
    defaults: dict[str, Any] = field(default_factory=dict)

    def reserved(self) -> set[str]:
        """Output columns lmprog writes itself (an input column of that name clashes)."""
        return reserved_columns(
            self.id_column, self.index_column, self.include_text, self.include_usage
        )


def reserved_columns(
    id_column: str | None, index_column: str | None, include_text: bool, include_usage: bool
) -> set[str]:
    """Output columns lmprog writes itself, for these options (`MapOptions.reserved`)."""
    names = {"ret_value", "error"} | ({"text"} if include_text else set())
    names |= set(USAGE_COLUMNS) if include_usage else set()
    return names | ({index_column} if index_column and not id_column else set())


class RowJob(NamedTuple):
    position: int  # in the input
    order: int  # among the rows this run runs, in input order (emission order)
    row: dict[str, Any]
    sort_key: str


class RowResult(NamedTuple):
    row: dict[str, Any]
    usage: dict[str, int]
    is_error: bool
    is_cancelled: bool = False  # the map was stopped while it ran: not a finished row


def iter_results(
    fn: Function,
    source: RowSource,
    backend: Backend,
    opts: MapOptions,
    sink: JsonlSink | None,
    progress: Progress,
) -> Iterator[dict[str, Any]]:
    """Result rows of `fn` over `source` (see the module docstring)."""
    template = PrefixTemplate(fn) if opts.cache_aware else None
    runner = _RowRunner(fn, backend, opts)
    rows = enumerate(iter(source))
    done = sink.done if sink is not None else set()
    failed = sink.failed if sink is not None else set()
    seen: set[str] = set()
    order = itertools.count()
    pending: deque[RowJob] = deque()
    inflight: dict[Future, RowJob] = {}
    # Finished rows not yet out (ordered: waiting for earlier ones), with their lines.
    finished: dict[int, tuple[dict[str, Any], bytes | None]] = {}
    next_out = 0
    unwritten: list[bytes] = []  # lines of rows out, not yet written
    last_write = time.monotonic()
    is_exhausted = is_complete = False
    reserved = opts.reserved()

    def read_window() -> list[RowJob]:
        nonlocal is_exhausted
        jobs: list[RowJob] = []
        for position, row in rows:
            clash = reserved & row.keys()
            if clash:
                raise ValueError(
                    f"row {position}: input column(s) {sorted(clash)} clash with "
                    "the output's own columns; rename them"
                )
            if sink is not None:
                key = row_key(_row_id(row, position, opts.id_column))
                if key in seen:
                    raise ValueError(f"id_column {opts.id_column!r}: id {key} appears twice")
                seen.add(key)
                if key in done:
                    progress.row_skipped(key in failed)
                    continue
            sort_key = template.prefix(row) if template is not None else ""
            jobs.append(RowJob(position, next(order), row, sort_key))
            if len(jobs) == opts.window:
                return jobs
        is_exhausted = True
        return jobs

    def collect(job: RowJob, result: RowResult) -> None:
        """A finished row, and its line: a row JSON cannot hold as it is gets an error."""
        row, is_error, line = result.row, result.is_error, None
        if sink is not None:
            encoded = sink.encode(row)  # (now: the caller may change the row it gets)
            if encoded.problem is not None:
                error = row["error"]
                row["error"] = encoded.problem if error is None else f"{error}; {encoded.problem}"
                is_error = True
                encoded = sink.encode(row)
            line = encoded.line
        progress.row_done(result.usage, is_error)
        finished[job.order] = (row, line)

    def write(force: bool) -> None:
        nonlocal last_write
        if (
            sink is not None
            and unwritten
            and (force or len(unwritten) >= FLUSH_ROWS or time.monotonic() - last_write >= FLUSH_S)
        ):
            sink.write(unwritten)
            unwritten.clear()
            last_write = time.monotonic()

    def save_finished() -> None:
        """(The map stopped early.) Every row that has finished goes to the file, in
        whatever order: those waiting for an earlier row and those done but not yet
        collected. (A resumed run finds rows by their key, never by their place in the
        file.)"""
        if sink is None:
            return
        for future, job in list(inflight.items()):
            if future.done():
                del inflight[future]
                is_done = not future.cancelled() and future.exception() is None
                if is_done and not future.result().is_cancelled:
                    collect(job, future.result())
        unwritten.extend(line for _, (_, line) in sorted(finished.items()) if line)
        finished.clear()
        write(force=True)

    try:
        while True:
            while not pending and not is_exhausted and len(inflight) + len(finished) < opts.window:
                window = read_window()
                pending.extend(sorted(window, key=lambda job: job.sort_key))
            while pending and len(inflight) < opts.num_threads:
                job = pending.popleft()
                inflight[runner.pool.submit(runner.run, job)] = job
            if not inflight:
                break
            # (a wake at least every FLUSH_S: finished rows are written while none ends)
            ready, _ = wait(inflight, timeout=FLUSH_S, return_when=FIRST_COMPLETED)
            out: list[tuple[dict[str, Any], bytes | None]] = []
            for future in ready:
                collect(inflight.pop(future), future.result())
            if opts.ordered:
                while next_out in finished:
                    out.append(finished.pop(next_out))
                    next_out += 1
            else:
                out = list(finished.values())
                finished.clear()
            # all of them, before the caller may stop at a yield
            unwritten.extend(line for _, line in out if line is not None)
            write(force=False)
            for row, _ in out:
                yield row
        is_complete = True
    finally:
        try:
            if not is_complete:
                runner.cancel()
                # Before waiting for rows still busy in Python code: a second Ctrl-C while
                # waiting lost every finished row.
                save_finished()
        finally:
            try:
                runner.pool.shutdown(wait=True, cancel_futures=True)
                if not is_complete:
                    save_finished()
                write(force=True)
            finally:
                if sink is not None:
                    sink.close(is_complete)
                progress.close()


class _RowRunner:
    """Runs one row's program on a pool thread; cancels the programs still running."""

    def __init__(self, fn: Function, backend: Backend, opts: MapOptions) -> None:
        self.fn = fn
        self.backend = backend
        self.opts = opts
        self.params = program_params(fn)
        # A program with `**columns` takes every column no named parameter takes.
        every = list(inspect.signature(fn.func).parameters.values())
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in every)
        self.state_name = every[0].name if every else ""  # (`s`: never a column's)
        self.pool = ThreadPoolExecutor(opts.num_threads, thread_name_prefix="lmprog-map")
        self._running: dict[int, ProgramState] = {}
        self._cancelled: list[BaseException] = []

    def run(self, job: RowJob) -> RowResult:
        args, kwargs, missing = self._bind(job.row)
        if missing is not None:
            error = KeyError(
                f"row has no column {missing!r} for the argument of {self.fn.__name__}()"
            )
            return RowResult(self._result(job, None, error, {}), {}, True)
        backend = UsageBackend(self.backend)
        try:
            state = ProgramState.start(backend, self.opts.defaults)
        except Exception as error:  # noqa: BLE001 - this row fails, the others go on
            return RowResult(self._result(job, None, error, {}), {}, True)
        self._running[job.order] = state
        if self._cancelled:  # started while the map was being stopped
            state._cancel(self._cancelled[0])
        self.fn._execute(state, args, kwargs)
        state._wait_done()
        del self._running[job.order]
        error = state._stream.failure()
        usage = dict(backend.usage)
        is_cancelled = bool(self._cancelled) and error is self._cancelled[0]
        row = self._result(job, state, error, usage)
        return RowResult(row, usage, error is not None, is_cancelled)

    def cancel(self) -> None:
        self._cancelled.append(RuntimeError("the map was stopped before this row finished"))
        for state in list(self._running.values()):
            state._cancel(self._cancelled[0])

    def _bind(self, row: dict[str, Any]) -> tuple[list[Any], dict[str, Any], str | None]:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in self.params:
            if p.name in row:
                value = row[p.name]
            elif p.default is not p.empty:
                value = p.default
            else:
                return args, kwargs, p.name
            if p.kind is p.POSITIONAL_ONLY:
                args.append(value)
            else:
                kwargs[p.name] = value
        if self.takes_all:
            named = {p.name for p in self.params} | self.fn.bound.keys() | {self.state_name}
            kwargs.update((k, v) for k, v in row.items() if k not in named)
        return args, kwargs, None

    def _result(
        self,
        job: RowJob,
        state: ProgramState | None,
        error: BaseException | None,
        usage: dict[str, int],
    ) -> dict[str, Any]:
        opts = self.opts
        out = dict(job.row)
        if opts.index_column is not None and opts.id_column is None:
            out[opts.index_column] = job.position
        taken = set(out) | opts.reserved()
        if state is not None:
            st = state._stream.st  # the program has ended: its state no longer changes
            for name, value in st.variables.items():
                out[free_name(name, taken | out.keys())] = value
        out["ret_value"] = state.ret_value if state is not None else None
        if opts.include_text:
            out["text"] = state._stream.st.text if state is not None else None
        if opts.include_usage:
            out.update({name: usage.get(name, 0) for name in USAGE_COLUMNS})
        out["error"] = None if error is None else describe_error(error)
        return out


def _row_id(row: dict[str, Any], position: int, id_column: str | None) -> Any:
    if id_column is None:
        return position
    if id_column not in row:
        raise ValueError(f"row {position} has no id_column {id_column!r}")
    value = row[id_column]
    if value is None or isinstance(value, float):
        raise ValueError(
            f"row {position}: id_column {id_column!r} must be a str or int, got {value!r}"
        )
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # written with U+FFFD, it would never match again
            raise ValueError(
                f"row {position}: id_column {id_column!r} holds a lone surrogate: {value!r}"
            ) from None
    return value
