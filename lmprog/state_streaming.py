"""Reading a program's text as it is produced: `text_iter` and `text_async_iter` of a
`ProgramState` (`run(stream=True)`), and the whole text or value once for any other state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager
from typing import Any

from lmprog.stream import Stream


class StreamReading:
    """The streaming reads of a program state: what it yields, chunk by chunk."""

    _stream: Stream

    def _cancel_on_interrupt(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _outside_body(self) -> bool:
        raise NotImplementedError

    def _raise_error(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def text(self) -> str:
        raise NotImplementedError

    def __getitem__(self, name: str) -> Any:
        raise NotImplementedError

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (all of it, or one variable's) for `run(stream=True)`;
        for any other state, the whole text (or the variable) once it is there."""
        if not self._stream.is_streaming:
            yield self.text() if var_name is None else self[var_name]
            return
        start, is_done, streamed = 0, False, False
        while not is_done:
            with self._cancel_on_interrupt():
                deltas, start, is_done = self._stream.next_deltas(
                    start, var_name, release=not self._outside_body()
                )
            for delta, _ in deltas:
                streamed = True
                yield delta
        self._raise_error()
        self._check_produced(var_name)
        if var_name is not None and not streamed:  # (set, or gathered by a join: whole)
            yield from self._unstreamed(var_name)

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for asyncio. With `return_meta_data`, yields `(delta, meta_info)`: the
        gen's meta info so far (its `output_token_logprobs` grow chunk by chunk; a reader
        behind gets the latest for its earlier deltas)."""
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        # A thread of its own waits for the text: on the loop's default executor, a few
        # consumers waiting on slow programs held every thread, and the others starved.
        waiter = ThreadPoolExecutor(1, thread_name_prefix="lmprog-async-iter")
        try:
            if not self._stream.is_streaming:
                await loop.run_in_executor(waiter, self.sync)
                if var_name is None:
                    yield (self.text(), None) if return_meta_data else self.text()
                else:
                    value = self[var_name]
                    meta = self._stream.st.meta.get(var_name)
                    yield (value, meta) if return_meta_data else value
                return
            start, is_done, streamed = 0, False, False
            while not is_done:
                deltas, start, is_done = await loop.run_in_executor(
                    waiter, self._stream.next_deltas, start, var_name
                )
                for delta, meta in deltas:
                    streamed = True
                    yield (delta, meta) if return_meta_data else delta
            self._raise_error()
            self._check_produced(var_name)
            if var_name is not None and not streamed:  # (set, or gathered by a join: whole)
                meta = self._stream.st.meta.get(var_name)
                for value in self._unstreamed(var_name):
                    yield (value, meta) if return_meta_data else value
        finally:
            waiter.shutdown(wait=False)  # (a wait in progress ends with the program)

    def _unstreamed(self, var_name: str) -> Iterator[Any]:
        """A variable no gen streamed (set, or a list a join gathered from fork branches):
        its value, once, as a state that does not stream gives it (it gave nothing)."""
        value = self._stream.st.variables[var_name]
        if value is not None and value != "":
            yield value

    def _check_produced(self, var_name: str | None) -> None:
        """A streamed variable the program never produced (a misspelt name) is a KeyError
        once the program has ended, as a read of it is; it ended the stream silently."""
        variables = self._stream.st.variables
        if var_name is not None and var_name not in variables:
            raise KeyError(f"unknown variable {var_name!r}; this state has {sorted(variables)}")
