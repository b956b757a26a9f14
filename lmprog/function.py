"""The `@function` decorator: a Python function over a state `s` becomes a runnable program.

`run` executes one program; `run_batch` runs many concurrently (so their requests reach the
runtime together) and returns their states in input order; `bind` fixes arguments; calling
a Function on a state inside another program inlines it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmprog.backend import as_backend, get_default_backend
from lmprog.interpreter import SAMPLING_KEYS, ExecState
from lmprog.ir import Fork
from lmprog.planner import resolve, run_waves
from lmprog.state import ProgramState
from lmprog.traced import TracedProgram
from lmprog.tracer import trace

# run(...) keywords that set program-level sampling defaults (gen arguments left None).
_RUN_SAMPLING = {**{k: k for k in SAMPLING_KEYS}, "max_new_tokens": "max_tokens"}


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

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Inline this program into a running one: `other_program(s, ...)`."""
        from lmprog.tracer import TracerState

        if not isinstance(s, (ProgramState, TracerState)):
            raise TypeError(
                f"{self.func.__name__} is an lp.function: call .run(...) to run it, or pass the "
                "state of the program it is called from as the first argument"
            )
        return self.func(s, *args, **{**self.bound, **kwargs})

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
        eager: bool = False,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once. Keywords that are sampling parameters (`temperature`,
        `max_new_tokens`, `stop`, ...) become defaults for every `gen`; the rest are the
        program's arguments. The program is traced and run as waves; a program the tracer
        cannot see through (it branches on a generated value) runs eagerly, as does
        `stream=True` or `eager=True`. Exceptions are raised; `error()` also holds them."""
        defaults, arguments = _split_kwargs(kwargs)
        if not (stream or eager):
            return self._run_traced([(args, arguments)], defaults, backend, raise_errors=True)[0]
        state = self._start(args, arguments, defaults, backend, stream)
        if not stream:
            state.sync()
            state._raise_error()
        return state

    def run_batch(
        self,
        batch: Sequence[dict[str, Any] | tuple | list],
        *,
        progress_bar: bool = False,
        backend: Any = None,
        num_threads: int | None = None,
        eager: bool = False,
        **sampling_defaults: Any,
    ) -> list[ProgramState]:
        """Run one program per item (a dict of keyword arguments or a tuple of positional
        ones). Traced programs run together as waves after their shared constant prefix is
        computed once; the rest (and all with `eager=True`) run concurrently, one thread
        each. States come back in input order; a program that fails keeps its exception in
        `error()` and the others finish."""
        defaults, extra = _split_kwargs(sampling_defaults)
        if extra:
            raise TypeError(f"run_batch got unknown keyword arguments {sorted(extra)}")
        items = list(batch)
        for item in items:
            if not isinstance(item, (dict, tuple, list)):
                raise TypeError("run_batch takes a list of dicts (keyword args) or tuples")
        calls = [((), item) if isinstance(item, dict) else (tuple(item), {}) for item in items]
        if not eager:
            return self._run_traced(
                calls, defaults, backend, raise_errors=False, progress=progress_bar
            )
        return self._run_eager(calls, defaults, backend, num_threads, progress_bar)

    def _run_eager(
        self,
        calls: list[tuple[tuple, dict]],
        defaults: dict[str, Any],
        backend: Any,
        num_threads: int | None = None,
        progress: bool = False,
        resume: list[tuple[ExecState, int] | None] | None = None,
    ) -> list[ProgramState]:
        """One thread per program; each state's executor sends its requests as it goes.
        `resume[i]` = (state, n): program i already ran its first n appends (as waves);
        the Python code runs again and continues from there."""
        resolved = as_backend(backend) if backend is not None else get_default_backend()
        workers = num_threads or min(64, max(1, len(calls)))
        resumes = resume or [None] * len(calls)

        def one(call: tuple[tuple, dict], start: tuple[ExecState, int] | None) -> ProgramState:
            args, kwargs = call
            exec_state, skip = start if start is not None else (None, 0)
            state = ProgramState(resolved, defaults, exec_state=exec_state, skip=skip)
            try:
                state.ret_value = self.func(state, *args, **{**self.bound, **kwargs})
                state.sync()
            except BaseException as error:  # noqa: BLE001 - kept in the state, never lost
                state.sync()
                if state._executor.error is None:
                    state._executor.error = error
            return state

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(calls), desc=self.func.__name__)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(one, call, start) for call, start in zip(calls, resumes)]
            states = []
            for future in futures:
                states.append(future.result())
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states

    def _run_traced(
        self,
        calls: list[tuple[tuple, dict]],
        defaults: dict[str, Any],
        backend: Any,
        *,
        raise_errors: bool,
        progress: bool = False,
    ) -> list[ProgramState]:
        resolved = as_backend(backend) if backend is not None else get_default_backend()
        states: list[ProgramState | None] = [None] * len(calls)
        waves: list[tuple[int, TracedProgram]] = []  # complete traces, or stopped ones to resume
        eager: list[int] = []
        for i, (args, kwargs) in enumerate(calls):
            try:
                program = self.trace(*args, backend=resolved, **kwargs)
            except Exception as error:  # a static error: no request is sent for it
                if raise_errors:
                    raise
                states[i] = _failed_state(resolved, defaults, error)
                continue
            has_fork = any(isinstance(d["node"], Fork) for _, d in program.graph.nodes(data=True))
            if program.is_complete or not has_fork:
                waves.append((i, program))
            else:
                eager.append(i)  # a stopped trace with forks reruns whole, eagerly
        results = run_waves(resolved, defaults, [p for _, p in waves]) if waves else []
        resume_calls, resume_from = [], []
        for (i, program), (exec_state, error) in zip(waves, results):
            if program.is_complete or error is not None:
                state = ProgramState(resolved, defaults, exec_state=exec_state)
                state._executor.error = error
                if error is None:
                    state.ret_value = resolve(program.ret, exec_state.variables)
                states[i] = state
            else:  # the traced part ran as waves; the rest runs eagerly from there
                resume_calls.append(i)
                resume_from.append((exec_state, len(program.stream(()))))
        for i, state in zip(eager, self._run_eager([calls[i] for i in eager], defaults, resolved)):
            states[i] = state
        resumed = self._run_eager(
            [calls[i] for i in resume_calls], defaults, resolved, resume=resume_from
        )
        for i, state in zip(resume_calls, resumed):
            states[i] = state
        if raise_errors:
            states[0]._raise_error()
        if progress:
            from tqdm.auto import tqdm

            for _ in tqdm(states, desc=self.func.__name__):
                pass
        return states  # type: ignore[return-value]

    def _start(self, args, arguments, defaults, backend, stream) -> ProgramState:
        resolved = as_backend(backend) if backend is not None else get_default_backend()
        state = ProgramState(resolved, defaults, stream=stream)
        state.ret_value = self.func(state, *args, **{**self.bound, **arguments})
        return state


def _failed_state(backend: Any, defaults: dict[str, Any], error: BaseException) -> ProgramState:
    state = ProgramState(backend, defaults)
    state._executor.error = error
    return state


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    defaults, arguments = {}, {}
    for key, value in kwargs.items():
        if key in _RUN_SAMPLING:
            defaults[_RUN_SAMPLING[key]] = value
        else:
            arguments[key] = value
    return defaults, arguments


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: `@lp.function` or `@lp.function()`; the function's first parameter is `s`.

    Example:
        >>> @lp.function
        ... def greet(s, name):
        ...     s += "Hello, " + name + "!" + lp.gen("rest", max_tokens=8)
    """
    if options:
        raise TypeError(f"lp.function takes no options yet, got {sorted(options)}")
    if func is None:
        return function
    return Function(func)
