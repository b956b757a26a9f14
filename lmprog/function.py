"""The `@function` decorator: a Python function over a state `s` becomes a runnable program.

`run` executes one program on the caller's thread (with `stream=True`, on a thread of its
own, returning at once); `run_batch` runs many on a bounded pool
of threads (their requests reach the runtime together) and returns their states in input
order, or as they finish; `map` runs one per row of a dataset (`lmprog.datasets`); `bind`
fixes arguments; calling a Function runs it, or inlines it when its first argument is the
state of a running program.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Literal, overload

from lmprog.backend import Backend, as_backend, get_default_backend
from lmprog.display import in_notebook, show_live
from lmprog.run_options import check_flag, check_num_threads, split_kwargs
from lmprog.state import ProgramState
from lmprog.traced import TracedProgram
from lmprog.tracer import TracerState, trace

if TYPE_CHECKING:
    from lmprog.datasets import MapRun
    from lmprog_runtime.engine import Engine


class Function:
    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(
                f"@lp.function {func.__name__!r} must take the program state as its first "
                "parameter, e.g. `def program(s, question): ...`"
            )
        self.func = func
        self.bound = dict(bound or {})
        self.arg_names = [p.name for p in params[1:]]
        # (the arguments a keyword can name: `run` gives them precedence over gen defaults)
        self.keyword_names = frozenset(
            p.name
            for p in params[1:]
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        )
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some arguments fixed."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(self.func).parameters.values()
        ):
            raise TypeError(f"{self.func.__name__}() has no argument(s) {sorted(unknown)}")
        return Function(self.func, {**self.bound, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside a program, `other(s, ...)` inlines `other` into it; called without a state,
        it runs the program: `f(question=...)` is `f.run(question=...)`."""
        if args and isinstance(args[0], (ProgramState, TracerState)):
            return self.func(args[0], *args[1:], **{**self.bound, **kwargs})
        return self.run(*args, **kwargs)

    def trace(
        self, *args: Any, backend: Backend | Engine | None = None, **kwargs: Any
    ) -> TracedProgram:
        """Trace the program without running it: arguments not given stay symbolic.

        Static errors (a variable nothing produces, duplicate or empty select choices,
        conflicting names, an invalid regex or schema) raise ValueError here.

        Example:
            >>> traced = triage.trace()  # doctest: +SKIP
            >>> traced.graph, traced.prefix, print(traced), traced.to_dot()  # doctest: +SKIP
        """
        tracer, ret = trace(self.func, args, {**self.bound, **kwargs})
        resolved = as_backend(backend) if backend is not None else None
        return TracedProgram(tracer.graph, tracer.stopped, ret, resolved)

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Backend | Engine | None = None,
        live: bool | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once. Keywords that are sampling or request options
        (`temperature`, `max_new_tokens`, `stop`, `return_logprob`, ...) become defaults
        for every `gen`, unless the program has a parameter of that name (`def
        summarize(s, text, max_tokens)`): then it is the program's argument, as are the
        other keywords.

        Returns when the program has finished, or with `stream=True` at once, the body
        running on a thread of its own as in SGLang: read the text as it comes with
        `text_iter()`; on this thread `state[name]` waits for that variable, and `text()`,
        `sync()`, `error()` and `ret_value` for the body to return and its nodes to run.
        In a Jupyter notebook a streaming run also shows its transcript in the cell,
        updated in place as tokens arrive (`live=False` turns that off; `live=True` asks
        for it). An exception (the program's own, or a request the runtime refused) is
        raised unchanged; `error()` holds it too."""
        check_flag("stream", stream)
        check_flag("live", live, none_ok=True)
        defaults, arguments = split_kwargs(kwargs, self.keyword_names)
        resolved = _resolve(backend)
        if not stream:  # (before anything is sent: its requests would hold their slots)
            resolved.check_can_wait("run()")
        state = ProgramState.start(resolved, defaults, stream=stream)
        if stream:
            if live or (live is None and in_notebook()):
                show_live(state)
            body = threading.Thread(
                target=self._execute,
                args=(state, args, arguments),
                name=f"lmprog-stream-{self.func.__name__}",
            )
            state._body, state._caller = body, threading.get_ident()
            body.start()
            return state
        self._execute(state, args, arguments)
        try:
            state._wait_done()
        except BaseException as error:  # Ctrl-C: its requests stop, then it goes on
            state._cancel(error)
            raise
        state._raise_error()
        return state

    @overload
    def run_batch(
        self,
        batch: Sequence[dict[str, Any] | tuple[Any, ...] | list[Any]],
        *,
        num_threads: int | str = ...,
        progress_bar: bool = ...,
        generator_style: Literal[False] = ...,
        backend: Backend | Engine | None = ...,
        **defaults: Any,
    ) -> list[ProgramState]: ...
    @overload
    def run_batch(
        self,
        batch: Sequence[dict[str, Any] | tuple[Any, ...] | list[Any]],
        *,
        num_threads: int | str = ...,
        progress_bar: bool = ...,
        generator_style: Literal[True],
        backend: Backend | Engine | None = ...,
        **defaults: Any,
    ) -> Iterator[ProgramState]: ...
    @overload
    def run_batch(  # (a flag known only at run time)
        self,
        batch: Sequence[dict[str, Any] | tuple[Any, ...] | list[Any]],
        *,
        num_threads: int | str = ...,
        progress_bar: bool = ...,
        generator_style: bool = ...,
        backend: Backend | Engine | None = ...,
        **defaults: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]: ...
    def run_batch(
        self,
        batch: Sequence[dict[str, Any] | tuple[Any, ...] | list[Any]],
        *,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        backend: Backend | Engine | None = None,
        **defaults: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run one program per item (a dict of keyword arguments, or a tuple of positional
        ones) on a pool of `num_threads` threads (`"auto"`: up to 128), each running a body
        and waiting for its program to finish before taking the next item.

        Returns the states in input order, or with `generator_style=True` an iterator that
        yields each state as its program finishes. A program that fails keeps its
        exception in `error()`; the others go on."""
        defaults, extra = split_kwargs(defaults, self.keyword_names)
        if extra:
            raise TypeError(
                f"run_batch got keyword arguments {sorted(extra)} that are no sampling "
                "options: give the program's arguments in each item, or fix them with "
                ".bind(...)"
            )
        check_flag("progress_bar", progress_bar)
        check_flag("generator_style", generator_style)
        if isinstance(batch, (str, bytes, dict)) or not hasattr(batch, "__iter__"):
            raise TypeError(
                f"run_batch takes a list of dicts or tuples, got {type(batch).__name__}"
            )
        items = list(batch)
        for item in items:
            if not isinstance(item, (dict, tuple, list)):
                raise TypeError("run_batch takes a list of dicts (keyword args) or tuples")
        num_threads = check_num_threads(num_threads)
        resolved = _resolve(backend)
        calls = [((), item) if isinstance(item, dict) else (tuple(item), {}) for item in items]
        states = self._run_pool(
            calls, resolved, defaults, min(num_threads, max(1, len(calls))), progress_bar
        )
        if generator_style:
            return (state for _, state in states)
        ordered: list[ProgramState | None] = [None] * len(calls)
        for i, state in states:
            ordered[i] = state
        return ordered  # type: ignore[return-value]

    def map(
        self,
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
        window: int = 1024,
        num_threads: int | str = "auto",
        progress: bool = False,
        backend: Backend | Engine | None = None,
        **defaults: Any,
    ) -> MapRun:
        """Run the program once per row of `data`: a list (or iterable) of dicts, a pandas
        DataFrame, a Hugging Face `datasets.Dataset`, or a `.jsonl` / `.csv` / `.parquet`
        path. Columns named like the program's arguments are passed to it; keywords such
        as `temperature` are defaults for every gen, as in `run`.

        Returns a `MapRun`, which runs as it is iterated: each result row is the input
        row's columns, one column per program variable (`var_<name>` where that name is
        taken), `ret_value`, `text` (with `include_text`), `prompt_tokens` /
        `cached_tokens` / `completion_tokens` (with `include_usage`) and `error` (None, or
        the exception that ended that row: one row's failure never stops the others).
        Without `id_column`, `row_index` holds the row's input position. Rows come back
        in input order, or as they finish with `ordered=False`. `run()` drives it to the
        end and returns a `MapSummary`.

        Rows are read `window` at a time (memory stays flat in the number of rows) and,
        with `cache_aware`, run grouped by their prompt prefix so the radix cache stays
        hot (the program is traced once, symbolically, to find its prompt template: code
        before its first gen runs once more, with placeholder arguments). With `output`
        (`.jsonl`, or `.parquet` built at the end from `<output>.journal.jsonl`), rows are
        appended durably as they come out; after a crash, `resume=True` skips the rows
        the file holds (by `id_column`, or row index), and with `retry_errors=True` runs
        those that failed again (their lines are taken out of the file).
        `progress=True` shows a bar with rows/s, output tokens/s, cache hit rate, errors.

        Example:
            >>> for row in qa.map([{"question": "Hi?"}], temperature=0):  # doctest: +SKIP
            ...     row["answer"], row["error"]
            >>> qa.map("in.jsonl", output="out.parquet", id_column="id", resume=True).run()  # doctest: +SKIP
        """
        from lmprog.datasets import map_program

        return map_program(
            self,
            data,
            output=output,
            id_column=id_column,
            resume=resume,
            retry_errors=retry_errors,
            ordered=ordered,
            cache_aware=cache_aware,
            include_text=include_text,
            include_usage=include_usage,
            window=window,
            num_threads=num_threads,
            progress=progress,
            backend=backend,
            **defaults,
        )

    def _run_pool(self, calls, backend, defaults, num_threads, progress_bar) -> Iterator:
        """(index, state) pairs as programs finish; the pool's threads end with it."""
        backend.check_can_wait(f"{self.func.__name__}'s batch")
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(calls), desc=self.func.__name__)

        running: dict[int, ProgramState] = {}
        cancelled: list[BaseException] = []

        def one(i: int) -> tuple[int, ProgramState]:
            args, kwargs = calls[i]
            state = ProgramState.start(backend, defaults)
            running[i] = state
            if cancelled:  # started while the batch was being cancelled
                state._cancel(cancelled[0])
            self._execute(state, args, kwargs)
            state._wait_done()
            del running[i]
            return i, state

        # Programs are queued a window ahead of the threads, and a finished one's future is
        # dropped once handed out: with all of them queued at once, each future kept its
        # state until the batch ended (a generator over 8,000 rows held 8,000 states).
        todo, pending = iter(range(len(calls))), set()
        pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="lmprog-program")
        is_stopped = False
        try:
            while True:
                for i in itertools.islice(todo, 2 * num_threads - len(pending)):
                    pending.add(pool.submit(one, i))
                if not pending:
                    break
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    if bar is not None:
                        advance_bar(bar)
                    yield future.result()
                del done
        except BaseException as error:  # Ctrl-C, or the generator closed: they stop
            is_stopped = True
            if isinstance(error, GeneratorExit):  # (nobody will read them)
                error = RuntimeError("run_batch was stopped before this program finished")
            cancelled.append(error)
            for state in list(running.values()):
                state._cancel(error)
            raise
        finally:
            for future in pending:  # programs queued but not started never start
                future.cancel()
            # Stopped, the cancelled programs end on their threads: a body busy with
            # work of its own (a tool call) held the Ctrl-C back until it returned.
            pool.shutdown(wait=not is_stopped)
            if bar is not None:
                bar.close()

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> None:
        """Run the body once; its exception fails the program (kept in `error()`) once
        what the body appended before its next request has run, and its requests still in
        flight are aborted: nothing will read them (Ctrl-C in the body fails it at once)."""
        stream = state._stream
        try:
            state.ret_value = self.func(state, *args, **{**self.bound, **kwargs})
        except Exception as error:  # noqa: BLE001 - kept in the state, never lost
            stream.interpreter.end_body(stream, error)
        except BaseException as error:  # noqa: BLE001 - kept in the state, never lost
            stream.interpreter.cancel(stream, error)
        finally:
            stream.close()


def advance_bar(bar: Any) -> None:
    """One more item done on a tqdm `bar`; the last of its total closes it, which prints
    the 100% line once: an `update` would print it first whenever the bar was due a
    refresh, and the close print it again (with `generator_style`, only once the caller
    asked for one more state, after what it printed itself)."""
    if bar.total is None or bar.n + 1 < bar.total:
        bar.update(1)
    else:
        bar.n = bar.total
        bar.close()


def _resolve(backend: Any):
    return as_backend(backend) if backend is not None else get_default_backend()


@overload
def function(func: Callable[..., Any], *, num_api_spec_tokens: int | None = None) -> Function: ...
@overload
def function(
    func: None = None, *, num_api_spec_tokens: int | None = None
) -> Callable[[Callable[..., Any]], Function]: ...
def function(
    func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None
) -> Function | Callable[[Callable[..., Any]], Function]:
    """Decorator: `@lp.function` or `@lp.function(...)`; the function's first parameter is
    `s`. `num_api_spec_tokens` (SGLang's speculative execution for API models) is accepted
    and has nothing to do in-process: every gen already runs on the local runtime.

    Example:
        >>> @lp.function
        ... def greet(s, name):
        ...     s += "Hello, " + name + "!" + lp.gen("rest", max_tokens=8)
    """
    if num_api_spec_tokens is not None and (
        not isinstance(num_api_spec_tokens, int) or num_api_spec_tokens < 0
    ):
        raise ValueError(f"num_api_spec_tokens must be an int >= 0, got {num_api_spec_tokens!r}")
    if func is None:
        return functools.partial(function, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func)
