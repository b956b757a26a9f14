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
from lmprog.interpreter import SAMPLING_KEYS
from lmprog.state import ProgramState

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
        if not isinstance(s, ProgramState):
            raise TypeError(
                f"{self.func.__name__} is an lp.function: call .run(...) to run it, or pass the "
                "state of the program it is called from as the first argument"
            )
        return self.func(s, *args, **{**self.bound, **kwargs})

    def run(
        self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any
    ) -> ProgramState:
        """Run the program once. Keywords that are sampling parameters (`temperature`,
        `max_new_tokens`, `stop`, ...) become defaults for every `gen`; the rest are the
        program's arguments. Exceptions are raised; `error()` also holds them."""
        defaults, arguments = _split_kwargs(kwargs)
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
        **sampling_defaults: Any,
    ) -> list[ProgramState]:
        """Run one program per item (a dict of keyword arguments or a tuple of positional
        ones), concurrently. States come back in input order; a program that fails keeps
        its exception in `error()` and the others finish."""
        defaults, extra = _split_kwargs(sampling_defaults)
        if extra:
            raise TypeError(f"run_batch got unknown keyword arguments {sorted(extra)}")
        items = list(batch)
        for item in items:
            if not isinstance(item, (dict, tuple, list)):
                raise TypeError("run_batch takes a list of dicts (keyword args) or tuples")
        resolved = as_backend(backend) if backend is not None else get_default_backend()
        workers = num_threads or min(64, max(1, len(items)))

        def one(item: dict | tuple | list) -> ProgramState:
            args, kwargs = ((), item) if isinstance(item, dict) else (tuple(item), {})
            state = ProgramState(resolved, defaults)
            try:
                state.ret_value = self.func(state, *args, **{**self.bound, **kwargs})
                state.sync()
            except BaseException as error:  # noqa: BLE001 - kept in the state, never lost
                state.sync()
                if state._executor.error is None:
                    state._executor.error = error
            return state

        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(items), desc=self.func.__name__)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(one, item) for item in items]
            states = []
            for future in futures:
                states.append(future.result())
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states

    def _start(self, args, arguments, defaults, backend, stream) -> ProgramState:
        resolved = as_backend(backend) if backend is not None else get_default_backend()
        state = ProgramState(resolved, defaults, stream=stream)
        state.ret_value = self.func(state, *args, **{**self.bound, **arguments})
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
