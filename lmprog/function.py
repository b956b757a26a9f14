"""The `@function` decorator: a Python function over a state `s` becomes a runnable program.

`run` executes one program on the caller's thread; `run_batch` runs many on a bounded pool
of threads (their requests reach the runtime together) and returns their states in input
order, or as they finish; `bind` fixes arguments; calling a Function runs it, or inlines it
when its first argument is the state of a running program.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from lmprog.backend import as_backend, get_default_backend
from lmprog.display import in_notebook, show_live
from lmprog.ops import REQUEST_KEYS, SAMPLING_KEYS
from lmprog.state import ProgramState
from lmprog.traced import TracedProgram
from lmprog.tracer import TracerState, trace

# run(...) keywords that set program-level defaults for every gen (gen arguments left None).
_RUN_DEFAULTS = {
    **{k: k for k in SAMPLING_KEYS},
    **{k: k for k in REQUEST_KEYS},
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
}
# SGLang's run options that do not apply in-process.
_RUN_IGNORED = ("use_thread",)
# run_batch(num_threads="auto"): enough programs in flight to fill the runtime's batches.
AUTO_THREADS = 128


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

    def trace(self, *args: Any, backend: Any = None, **kwargs: Any) -> TracedProgram:
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
        backend: Any = None,
        live: bool | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once, on this thread. Keywords that are sampling or request
        options (`temperature`, `max_new_tokens`, `stop`, `return_logprob`, ...) become
        defaults for every `gen`; the rest are the program's arguments.

        Returns when the program has finished, or with `stream=True` as soon as its body
        has run (read it with `text_iter()`). In a Jupyter notebook a streaming run also
        shows its transcript in the cell, updated in place as tokens arrive (`live=False`
        turns that off; `live=True` asks for it). An exception (the program's own, or a
        request the runtime refused) is raised unchanged; `error()` holds it too."""
        defaults, arguments = _split_kwargs(kwargs)
        state = ProgramState.start(_resolve(backend), defaults, stream=stream)
        if stream and (live or (live is None and in_notebook())):
            show_live(state)
        self._execute(state, args, arguments)
        if not stream:
            try:
                state._wait_done()
            except BaseException as error:  # Ctrl-C: its requests stop, then it goes on
                state._cancel(error)
                raise
            state._raise_error()
        return state

    def run_batch(
        self,
        batch: Sequence[dict[str, Any] | tuple | list],
        *,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        backend: Any = None,
        **defaults: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run one program per item (a dict of keyword arguments, or a tuple of positional
        ones) on a pool of `num_threads` threads (`"auto"`: up to 128), each running a body
        and waiting for its program to finish before taking the next item.

        Returns the states in input order, or with `generator_style=True` an iterator that
        yields each state as its program finishes. A program that fails keeps its
        exception in `error()`; the others go on."""
        defaults, extra = _split_kwargs(defaults)
        if extra:
            raise TypeError(f"run_batch got unknown keyword arguments {sorted(extra)}")
        items = list(batch)
        for item in items:
            if not isinstance(item, (dict, tuple, list)):
                raise TypeError("run_batch takes a list of dicts (keyword args) or tuples")
        if num_threads == "auto":
            num_threads = AUTO_THREADS
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int or 'auto', got {num_threads!r}")
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

    def _run_pool(self, calls, backend, defaults, num_threads, progress_bar) -> Iterator:
        """(index, state) pairs as programs finish; the pool's threads end with it."""
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

        with ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="lmprog-program"
        ) as pool:
            futures = [pool.submit(one, i) for i in range(len(calls))]
            try:
                for future in as_completed(futures):
                    if bar is not None:
                        bar.update(1)
                    yield future.result()
            except BaseException as error:  # Ctrl-C: the programs still running stop
                if not isinstance(error, GeneratorExit):
                    cancelled.append(error)
                    for state in list(running.values()):
                        state._cancel(error)
                raise
            finally:
                for future in futures:  # programs not started yet never start
                    future.cancel()
                if bar is not None:
                    bar.close()

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> None:
        """Run the body once; its exception fails the program (kept in `error()`)."""
        stream = state._stream
        try:
            state.ret_value = self.func(state, *args, **{**self.bound, **kwargs})
        except Exception as error:  # noqa: BLE001 - kept in the state, never lost
            stream.interpreter.fail(stream, error)
        except BaseException as error:  # Ctrl-C in the body: its requests stop too
            stream.interpreter.cancel(stream, error)
        finally:
            stream.close()


def _resolve(backend: Any):
    return as_backend(backend) if backend is not None else get_default_backend()


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    defaults, arguments = {}, {}
    for key, value in kwargs.items():
        if key in _RUN_DEFAULTS:
            defaults[_RUN_DEFAULTS[key]] = value
        elif key not in _RUN_IGNORED:
            arguments[key] = value
    return defaults, arguments


def function(
    func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None
) -> Any:
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
