"""`Engine.async_generate`: `generate` for asyncio, as SGLang's Engine has it.

Built on `Engine.submit`: the futures resolve on the engine's loop thread and are awaited
through `asyncio.wrap_future`, so the event loop never blocks (a plain `generate` in a
coroutine holds it for the whole generation); streamed chunks are handed to the event loop
with `call_soon_threadsafe`. A task cancelled while it awaits aborts its requests, which
then free their slots within one engine step.

`EngineAsync` holds this method of `Engine` (a mixin).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any


class EngineAsync:
    """The asyncio half of `Engine`'s caller side."""

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
        if stream:
            if not is_single:
                raise ValueError("stream=True takes a single prompt")
            return self._async_stream(prompt, sampling_params, inputs)
        futures = self.submit(prompt, sampling_params, **inputs)  # type: ignore[attr-defined]
        results = await self._awaited(futures)
        return results[0] if is_single else results

    async def _awaited(self, futures: list[Future]) -> list[dict[str, Any]]:
        """The futures' results; a cancelled wait aborts the requests still running."""
        try:
            return list(await asyncio.gather(*map(asyncio.wrap_future, futures)))
        except BaseException:
            for future in futures:
                if not future.done():
                    self.abort(future.request_id)  # type: ignore[attr-defined]
            raise

    async def _async_stream(
        self, prompt: Any, sampling_params: Any, inputs: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def hand_on(_: int, chunk: dict[str, Any]) -> None:  # (on the engine's loop thread)
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        (future,) = self.submit(  # type: ignore[attr-defined]
            prompt, sampling_params, on_chunk=hand_on, **inputs
        )
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(chunks.put_nowait, None))
        try:
            while (chunk := await chunks.get()) is not None:
                yield chunk
            future.result()  # (the request's error, if it failed)
        finally:
            if not future.done():  # (left early, or cancelled)
                self.abort(future.request_id)  # type: ignore[attr-defined]


def _is_nested(input_ids: list) -> bool:
    return bool(input_ids) and isinstance(input_ids[0], list)
