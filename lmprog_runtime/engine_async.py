"""`Engine.async_generate`: `generate` for asyncio, as SGLang's Engine has it.

Built on `Engine.submit`: the futures resolve on the engine's loop thread and are awaited
through `asyncio.wrap_future`, so the event loop never blocks (a plain `generate` in a
coroutine holds it for the whole generation); streamed chunks are handed to the event loop
with `call_soon_threadsafe`. A task cancelled while it awaits aborts its requests, which
then free their slots within one engine step; so does an event loop closed under a stream.
A `regex` / `json_schema` request is submitted from a worker thread, since its submit may
wait for the pattern to compile (up to `grammar_compile_timeout_s`): the event loop goes on.

`EngineAsync` holds this method of `Engine` (a mixin).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any, Literal, overload


class EngineAsync:
    """The asyncio half of `Engine`'s caller side."""

    # (for type checkers, as `generate`'s: a dict for one prompt, a list for a list, an async
    # iterator for a stream)
    @overload
    async def async_generate(
        self,
        prompt: str,
        sampling_params: dict[str, Any] | None = ...,
        *,
        input_ids: None = ...,
        return_logprob: bool | None = ...,
        logprob_start_len: int | None = ...,
        top_logprobs_num: int | None = ...,
        return_text_in_logprobs: bool | None = ...,
        stream: Literal[False] = ...,
        group: bool = ...,
    ) -> dict[str, Any]: ...
    @overload
    async def async_generate(
        self,
        prompt: None = ...,
        sampling_params: dict[str, Any] | None = ...,
        *,
        input_ids: list[int],
        return_logprob: bool | None = ...,
        logprob_start_len: int | None = ...,
        top_logprobs_num: int | None = ...,
        return_text_in_logprobs: bool | None = ...,
        stream: Literal[False] = ...,
        group: bool = ...,
    ) -> dict[str, Any]: ...
    @overload
    async def async_generate(
        self,
        prompt: list[str] | None = ...,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = ...,
        *,
        input_ids: list[list[int]] | None = ...,
        return_logprob: bool | list[bool] | None = ...,
        logprob_start_len: int | list[int] | None = ...,
        top_logprobs_num: int | list[int] | None = ...,
        return_text_in_logprobs: bool | list[bool] | None = ...,
        stream: Literal[False] = ...,
        group: bool = ...,
    ) -> list[dict[str, Any]]: ...
    @overload
    async def async_generate(
        self,
        prompt: str | None = ...,
        sampling_params: dict[str, Any] | None = ...,
        *,
        input_ids: list[int] | None = ...,
        return_logprob: bool | None = ...,
        logprob_start_len: int | None = ...,
        top_logprobs_num: int | None = ...,
        return_text_in_logprobs: bool | None = ...,
        stream: Literal[True],
        group: bool = ...,
    ) -> AsyncIterator[dict[str, Any]]: ...
    @overload
    async def async_generate(  # (arguments whose kind is known only at run time)
        self,
        prompt: str | list[str] | None = ...,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = ...,
        *,
        input_ids: list[int] | list[list[int]] | None = ...,
        return_logprob: bool | list[bool] | None = ...,
        logprob_start_len: int | list[int] | None = ...,
        top_logprobs_num: int | list[int] | None = ...,
        return_text_in_logprobs: bool | list[bool] | None = ...,
        stream: bool = ...,
        group: bool = ...,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]: ...
    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] | None = False,
        logprob_start_len: int | list[int] | None = -1,
        top_logprobs_num: int | list[int] | None = 0,
        return_text_in_logprobs: bool | list[bool] | None = False,
        stream: bool = False,
        group: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate`, awaited: the result dict for one prompt, a list for a list. With
        `stream=True` (one prompt), an async iterator of chunks whose `text` fields
        concatenate to the final text; leaving it early aborts the request.

        Example:
            >>> out = await engine.async_generate("Hi", {"max_new_tokens": 4})  # doctest: +SKIP
        """
        inputs = {"input_ids": input_ids, "return_logprob": return_logprob}
        inputs.update(logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)
        inputs.update(return_text_in_logprobs=return_text_in_logprobs, group=group)
        is_single = isinstance(prompt, str) or (
            prompt is None and isinstance(input_ids, list) and not _is_nested(input_ids)
        )
        if not stream:
            futures = await self._submitted(prompt, sampling_params, inputs)
            results = await self._awaited(futures)
            return results[0] if is_single else results
        if not is_single:
            raise ValueError("stream=True takes a single prompt")
        # Submitted here: bad input raises at the await, and the request starts at once.
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        submitted: list[Future[dict[str, Any]]] = []

        def hand_on(_: int, chunk: dict[str, Any] | None) -> None:  # (the engine's thread)
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, chunk)
            except RuntimeError:  # the event loop was closed: no one will read the rest
                for future in submitted:
                    self.abort(future.request_id)  # type: ignore[attr-defined]

        inputs["on_chunk"] = hand_on
        submitted += await self._submitted(prompt, sampling_params, inputs)
        submitted[0].add_done_callback(lambda _: hand_on(0, None))
        return AsyncChunks(self, submitted[0], chunks)

    async def _submitted(
        self, prompt: Any, sampling_params: Any, inputs: dict[str, Any]
    ) -> list[Future[dict[str, Any]]]:
        """`submit`'s futures; from a worker thread where a pattern may compile. A task
        cancelled meanwhile aborts the requests once they are submitted."""
        submit, may_compile = self.submit, self.may_compile  # type: ignore[attr-defined]
        call = functools.partial(submit, prompt, sampling_params, **inputs)
        every = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        if not any(isinstance(params, dict) and may_compile(params) for params in every):
            return call()
        submitted: Future[list[Future[dict[str, Any]]]] = Future()
        submitted.set_running_or_notify_cancel()  # (a cancelled await must not cancel it)

        def run() -> None:
            try:
                submitted.set_result(call())
            except BaseException as error:  # noqa: BLE001 - raised at the await
                submitted.set_exception(error)

        threading.Thread(target=run, name="lmprog-async-submit", daemon=True).start()
        try:
            return await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(self._abort_all)
            raise

    def _abort_all(self, submitted: Future) -> None:
        if submitted.exception() is None:
            for future in submitted.result():
                self.abort(future.request_id)  # type: ignore[attr-defined]

    async def _awaited(self, futures: list[Future]) -> list[dict[str, Any]]:
        """The futures' results; a cancelled wait aborts the requests still running."""
        try:
            return list(await asyncio.gather(*map(asyncio.wrap_future, futures)))
        except BaseException:
            for future in futures:
                if not future.done():
                    self.abort(future.request_id)  # type: ignore[attr-defined]
            raise


class AsyncChunks:
    """The chunks of one streamed request, for `async for`. Leaving it before its end
    (`aclose()`, a task cancelled while it waits, or the iterator dropped, read or not)
    aborts the request."""

    def __init__(self, engine: Any, future: Future, chunks: asyncio.Queue) -> None:
        self._future = future
        self._chunks = chunks
        self._is_over = False
        self._abort = weakref.finalize(self, engine.abort, future.request_id)

    def __aiter__(self) -> AsyncChunks:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._is_over:
            raise StopAsyncIteration
        try:
            chunk = await self._chunks.get()
        except BaseException:  # (cancelled while waiting)
            self._abort()
            raise
        if chunk is None:
            self._is_over = True
            self._abort.detach()
            self._future.result()  # (the request's error, if it failed)
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._is_over = True
        self._abort()


def _is_nested(input_ids: list) -> bool:
    return bool(input_ids) and isinstance(input_ids[0], list)
