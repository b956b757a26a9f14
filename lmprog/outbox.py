"""One interpreter round's requests, submitted together at its end (`Outbox.flush`).

Sibling fork branches' gens go as one request group; a request the backend refuses fails
only its own stream. A gen under a `regex` / `json_schema` not yet compiled may wait at
its submit for the pattern to compile (seconds, up to the engine's compile timeout):
those are submitted from a thread of their own, so the interpreter thread, which every
program in the process shares, never waits for a compile (one slow pattern held up every
program).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmprog.interpreter import Interpreter
    from lmprog.ir import Gen, Select
    from lmprog.ops import SelectPlan
    from lmprog.stream import Stream


class Outbox:
    """The requests of one interpreter round (see the module docstring)."""

    def __init__(self) -> None:
        self.gens: list[tuple[Stream, Gen, list[int], dict[str, Any]]] = []
        self.selects: list[tuple[Stream, Select, SelectPlan]] = []

    def flush(self, interp: Interpreter) -> None:
        groups: dict[tuple[int, ...], list] = {}  # (backend, [parent, fork]) -> its gens
        for item in self.gens:
            stream = item[0]
            backend = id(stream.ops.backend)
            key = (backend, id(stream.parent), stream.fork_id) if stream.parent else (backend,)
            groups.setdefault(key, []).append(item)
        for key, items in groups.items():
            group = len(key) > 1 and len(items) > 1
            if any(stream.is_compiling for stream, *_ in items):
                for stream, *_ in items:  # (a group goes together)
                    with stream.lock:
                        stream.is_compiling = True
                submit = functools.partial(self._submit_gens, interp, items, group)
                threading.Thread(target=submit, name="lmprog-submit", daemon=True).start()
            else:
                self._submit_gens(interp, items, group)
        for stream, sel, plan in self.selects:
            ids, starts = stream.ops.select_requests(plan)
            try:
                futures = stream.ops.backend.submit(
                    ids,
                    # (with the tokens' texts, as SGLang's select asks for them)
                    [{"max_new_tokens": 0, "return_text_in_logprobs": True}] * len(ids),
                    group=True,
                    return_logprob=True,
                    logprob_start_len=starts,
                )
            except Exception as error:  # noqa: BLE001 - refused: this program fails
                interp.post(functools.partial(_refused, interp, stream, error))
                continue
            stream.inflight = futures
            done = functools.partial(interp.select_done, stream, sel, plan, futures)
            countdown = _Countdown(len(futures), lambda done=done: interp.post(done))
            for future in futures:
                future.add_done_callback(countdown)

    def _submit_gens(self, interp: Interpreter, items: list, group: bool) -> None:
        backend = items[0][0].ops.backend
        streamed = [
            stream.is_streaming and not stream.ops.is_number_gen(gen) for stream, gen, _, _ in items
        ]

        def on_chunk(i: int, chunk: dict[str, Any]) -> None:
            if streamed[i]:
                stream, gen = items[i][0], items[i][1]
                interp.post(functools.partial(interp.gen_chunk, stream, gen, chunk))

        try:
            futures = backend.submit(
                [ids for _, _, ids, _ in items],
                [params for _, _, _, params in items],
                group=group,
                on_chunk=on_chunk if any(streamed) else None,
            )
        except Exception as error:  # noqa: BLE001 - find the refused one(s): submit alone
            if len(items) > 1:
                for item in items:
                    self._submit_gens(interp, [item], group=False)
            else:
                _done_compiling(items)
                error = _naming_gen(error, items[0][1])
                interp.post(functools.partial(_refused, interp, items[0][0], error))
            return
        for (stream, gen, _, _), future, is_streamed in zip(items, futures, streamed):
            with stream.lock:
                stream.inflight, stream.is_compiling = [future], False
                ended = stream.is_done or stream.error is not None  # (cancelled meanwhile)
            if ended:
                backend.abort([future])
            done = functools.partial(interp.gen_done, stream, gen, is_streamed)
            future.add_done_callback(lambda f, done=done: interp.post(functools.partial(done, f)))


def _done_compiling(items: list) -> None:
    for stream, *_ in items:
        with stream.lock:
            stream.is_compiling = False


class _Countdown:
    """Calls `then` once, when it has been called `count` times (from any threads), and
    lets it go: the futures that call it hold it, and `then` holds them (a cycle that kept
    the program, and the engine, until a full garbage collection)."""

    def __init__(self, count: int, then: Callable[[], None]) -> None:
        self._count = count
        self._then: Callable[[], None] | None = then
        self._lock = threading.Lock()

    def __call__(self, _: Any) -> None:
        with self._lock:
            self._count -= 1
            then = self._then if self._count == 0 else None
            if then is not None:
                self._then = None
        if then is not None:
            then()


def _naming_gen(error: Exception, gen: Gen) -> Exception:
    """A ValueError the runtime raised for a gen's request, its message prefixed with the
    gen's name where it does not start with it (a pattern too large or too slow to
    compile named neither the gen nor its variable)."""
    if type(error) is not ValueError or str(error).startswith("gen "):
        return error
    named = ValueError(f"gen {gen.name!r}: {error}")
    named.__cause__ = error
    return named


def _refused(interp: Interpreter, stream: Stream, error: BaseException) -> None:
    with stream.lock:
        stream.is_busy = False
    interp.fail(stream, error)
