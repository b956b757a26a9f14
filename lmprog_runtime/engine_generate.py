"""`Engine.generate` and `Engine.submit`: SGLang's offline-engine calls (a mixin of
`Engine`). The caller's thread checks and tokenizes the input into requests
(`request_maker.py`), hands them to the loop (`engine_calls.py`) and waits for their
results (`results.py`), or returns futures at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Literal, overload

from lmprog_runtime.engine_inputs import check_flags
from lmprog_runtime.gc_freeze import working
from lmprog_runtime.results import (
    RequestFuture,
    RequestStream,
    check_off_loop,
    resolve_future,
    wait_all,
    wake_once,
)


class EngineGenerate:
    """The synchronous half of `Engine`'s caller side."""

    # (for type checkers: one prompt gives a dict, a list a list, a stream an iterator)
    @overload
    def generate(
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
    def generate(
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
    def generate(
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
    def generate(
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
    ) -> Iterator[dict[str, Any]]: ...
    @overload
    def generate(  # (arguments whose kind is known only at run time)
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
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]: ...
    def generate(
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
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts).

        Each result is `{"text", "output_ids", "meta_info"}`; `meta_info` has
        `prompt_tokens`, `completion_tokens`, `cached_tokens`, `finish_reason` and, with
        `return_logprob`, `output_token_logprobs` (and `input_token_logprobs` for prompt
        positions from `logprob_start_len` on; `*_top_logprobs` with `top_logprobs_num`) as
        SGLang's `(logprob, token_id, text)` triples, the text None unless
        `return_text_in_logprobs`.
        `max_new_tokens=0` only prefills. With `stream=True` (one prompt), returns an
        iterator of chunks whose `text` fields concatenate to the final text. With
        `group=True` the prompts form one request group (the branches of a fork): their
        common prefix is computed once, then they are admitted together and decode in the
        same batches.

        Example:
            >>> engine.generate(["a", "b"], {"max_new_tokens": 4})  # doctest: +SKIP
        """
        check_flags(stream=stream, group=group)
        if not stream:  # (before its requests go in: they would run on, unread)
            check_off_loop(self, "generate()")
        # (a dataset's rows make many objects, here and in the results: `gc_freeze.py`)
        with working(self.config.gc_freeze):
            reqs, is_single = self._make_reqs(
                prompt,
                sampling_params,
                input_ids,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                return_text_in_logprobs,
                stream=stream,
            )
            if stream and not is_single:
                raise ValueError("stream=True takes a single prompt")
            woken = None if stream else wake_once(reqs)
            self._submit(self._make_group(reqs) if group and len(reqs) > 1 else reqs)
            if stream:
                return RequestStream(self, reqs[0])
            outputs = wait_all(self, reqs, woken)
        return outputs[0] if is_single else outputs

    def submit(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] | None = False,
        logprob_start_len: int | list[int] | None = -1,
        top_logprobs_num: int | list[int] | None = 0,
        return_text_in_logprobs: bool | list[bool] | None = False,
        group: bool = False,
        on_chunk: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> list[Future[dict[str, Any]]]:
        """`generate` without waiting: one `concurrent.futures.Future` per prompt, resolved
        with the result dict (or the request's error) when it finishes. `on_chunk(i, chunk)`
        receives prompt i's streamed deltas. Callbacks (`on_chunk` and the futures' done
        callbacks) run on the engine's loop thread: they must hand the result on, not block.
        Input errors raise here, before anything is submitted.

        Example:
            >>> futures = engine.submit(["a", "b"], {"max_new_tokens": 4})  # doctest: +SKIP
            >>> [f.result()["text"] for f in futures]  # doctest: +SKIP
        """
        check_flags(group=group)
        # (not frozen here unless the loop is busy: `working` would end before the loop takes
        # these up, and its end may owe a full pass, in the middle of the work)
        reqs, _ = self._make_reqs(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            stream=False,
        )
        futures: list[Future[dict[str, Any]]] = []
        for i, req in enumerate(reqs):
            future: Future[dict[str, Any]] = RequestFuture()
            future.set_running_or_notify_cancel()
            future.request_id = req.rid  # type: ignore[attr-defined] - for `abort`
            future.engine = self  # type: ignore[attr-defined] - alive till `resolve_future`
            req.on_done = functools.partial(resolve_future, future)
            if on_chunk is not None:
                req.on_chunk = functools.partial(on_chunk, i)
            futures.append(future)
        self._submit(self._make_group(reqs) if group and len(reqs) > 1 else reqs)
        return futures
