"""The narrow interface between the interpreter and a model runtime.

The interpreter speaks in strings and lists of token ids, never tensors. `EngineBackend`
implements the interface over an in-process `lmprog_runtime.Engine` through its public
API; another runtime (a server, a mock for fast tests) only needs these few methods.
"""

from __future__ import annotations

import functools
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from lmprog.chat_template import ChatRoles

if TYPE_CHECKING:
    from lmprog_runtime.engine import Engine


class Backend(ABC):
    """What a program needs from a model.

    Example:
        >>> backend = EngineBackend(lp.Engine())  # doctest: +SKIP
        >>> futures = backend.submit([backend.encode("Hi")], [{"max_new_tokens": 4}])  # doctest: +SKIP
        >>> futures[0].result()["text"]  # doctest: +SKIP
    """

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt text (special tokens written in the text are honoured)."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of token ids."""

    @abstractmethod
    def submit(
        self,
        input_ids: list[list[int]],
        params: list[dict[str, Any]],
        *,
        group: bool = False,
        return_logprob: bool = False,
        logprob_start_len: list[int] | None = None,
        on_chunk: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> list[Future[dict[str, Any]]]:
        """Submit requests without waiting: one Future per request, resolved with
        `{"text", "output_ids", "meta_info"}` as in `Engine.generate`. `group=True`
        co-schedules them (fork branches, choices); `on_chunk(i, chunk)` streams request
        i. Bad input raises here (ValueError / TypeError), before anything is submitted;
        callbacks must not block."""

    def check_constraint(self, kind: str, pattern: str) -> None:  # noqa: B027 - optional
        """Raise ValueError if this backend would refuse the constraint (`kind` "regex" or
        "json_schema", as JSON text): called when a gen is appended, before any request.
        A backend that cannot tell without compiling accepts it here."""

    def may_compile(self, params: dict[str, Any]) -> bool:
        """Whether a submit of a gen's `params` may wait for its `regex` / `json_schema` to
        compile. A backend that cannot tell says so for every constrained gen."""
        return params.get("regex") is not None or params.get("json_schema") is not None

    def check_can_wait(self, what: str) -> None:  # noqa: B027 - optional to override
        """Raise RuntimeError where `what` (a program's run, a read of its state) would
        wait for this backend's results on a thread that must deliver them (a callback
        on the runtime's own thread): it would wait forever, and so would every other
        request. A backend without such a thread accepts every wait."""

    def abort(self, futures: list[Future[dict[str, Any]]]) -> None:  # noqa: B027 - optional
        """Cancel the requests behind `futures` (from `submit`); their futures then fail.
        A backend that cannot cancel lets them run to the end."""

    def generate(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], **options: Any
    ) -> list[dict[str, Any]]:
        """`submit` and wait for every result."""
        return [future.result() for future in self.submit(input_ids, params, **options)]

    @abstractmethod
    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> str:
        """The model's chat template applied to `messages` (ValueError if it has none), with
        the text that prompts an assistant turn when `add_generation_prompt`."""

    @property
    @abstractmethod
    def context_token_id(self) -> int:
        """A neutral token to condition on when scoring text with no prompt."""

    def chat_roles(self) -> ChatRoles:
        """Role texts read off the chat template, computed once per backend."""
        roles = getattr(self, "_chat_roles", None)
        if roles is None:
            prompt = functools.partial(self.render_chat, add_generation_prompt=True)
            roles = self._chat_roles = ChatRoles(self.render_chat, prompt)
        return roles


class _ChatTemplate:
    """An engine's chat template, rendered under a lock, and the role texts read off it:
    kept per engine (`_engine_chats`), so its wrappers share them without holding it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.roles = ChatRoles(
            self,
            functools.partial(self, add_generation_prompt=True),
            trailers=getattr(tokenizer, "all_special_tokens", ()),
        )

    def __call__(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template, so roles (lp.system / lp.user / "
                "lp.assistant) cannot be rendered; write the prompt text yourself"
            )
        with self.lock:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )


class EngineBackend(Backend):
    """`Backend` over an in-process `lmprog_runtime.Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        with _wrappers_lock:
            chat = _engine_chats.get(engine)
            if chat is None:
                chat = _engine_chats[engine] = _ChatTemplate(engine.tokenizer)
        self._chat = chat

    def encode(self, text: str) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token", None)
        # A chat template that writes the BOS token itself must not get a second one.
        return self.engine.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    def check_can_wait(self, what: str) -> None:
        from lmprog_runtime.results import check_off_loop

        check_off_loop(self.engine, what, "run the program from a thread of your own")

    def submit(
        self,
        input_ids: list[list[int]],
        params: list[dict[str, Any]],
        *,
        group: bool = False,
        return_logprob: bool = False,
        logprob_start_len: list[int] | None = None,
        on_chunk: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> list[Future[dict[str, Any]]]:
        # A gen's own request options travel inside its params.
        params = [dict(p) for p in params]
        want = [bool(p.pop("return_logprob", False)) or return_logprob for p in params]
        tops = [int(p.pop("top_logprobs_num", None) or 0) for p in params]
        own_starts = [p.pop("logprob_start_len", None) for p in params]
        texts = [bool(p.pop("return_text_in_logprobs", None)) for p in params]
        if logprob_start_len is None:
            logprob_start_len = [-1 if s is None else s for s in own_starts]
        return self.engine.submit(
            input_ids=input_ids,
            sampling_params=params,
            return_logprob=want,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=tops,
            return_text_in_logprobs=texts,
            group=group,
            on_chunk=on_chunk,
        )

    def abort(self, futures: list[Future[dict[str, Any]]]) -> None:
        for future in futures:
            if not future.done():
                self.engine.abort(future.request_id)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> str:
        return self._chat(messages, add_generation_prompt)

    def check_constraint(self, kind: str, pattern: str) -> None:
        from lmprog_runtime.constrained.checks import check_constraint

        check_constraint(kind, pattern)

    def may_compile(self, params: dict[str, Any]) -> bool:
        return self.engine.may_compile(params)

    def chat_roles(self) -> ChatRoles:
        return self._chat.roles  # (one per engine, not per wrapper)

    @property
    def context_token_id(self) -> int:
        tok = self.tokenizer
        for candidate in (tok.bos_token_id, tok.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return 0


_default_backend: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Backend | Engine) -> None:
    """Programs run on `backend` (an `Engine` or a `Backend`) unless `run(backend=...)`."""
    global _default_backend
    with _default_lock:
        _default_backend = as_backend(backend)


def get_default_backend() -> Backend:
    with _default_lock:
        if _default_backend is None:
            raise RuntimeError(
                "no backend: call lp.set_default_backend(lp.Engine()) or pass run(backend=...)"
            )
        return _default_backend


def flush_cache(backend: Backend | Engine | None = None) -> bool:
    """SGLang's `sgl.flush_cache()`: drop every cached prefix of `backend`'s engine (the
    default backend's when None). Returns False (and drops nothing) while requests run."""
    resolved = as_backend(backend) if backend is not None else get_default_backend()
    engine = getattr(resolved, "engine", None)
    if engine is None:
        raise TypeError(f"{type(resolved).__name__} has no engine cache to flush")
    return engine.flush_cache()


# Engine -> its wrapper and its chat template, neither holding the engine: a value that did
# kept its key alive, and every engine a program had used stayed, loop thread and all.
_engine_backends: weakref.WeakKeyDictionary[Any, weakref.ref[EngineBackend]] = (
    weakref.WeakKeyDictionary()
)
_engine_chats: weakref.WeakKeyDictionary[Any, _ChatTemplate] = weakref.WeakKeyDictionary()
_wrappers_lock = threading.Lock()


def as_backend(backend: Any) -> Backend:
    """A `Backend` for an Engine: the one wrapper in use for it, else a new one (a wrapper
    holds its engine; the engine's chat template is kept with the engine, not the wrapper)."""
    if isinstance(backend, Backend):
        return backend
    if hasattr(backend, "generate") and hasattr(backend, "tokenizer"):
        with _wrappers_lock:
            ref = _engine_backends.get(backend)
            wrapper = ref() if ref is not None else None
        if wrapper is None:
            wrapper = EngineBackend(backend)
            with _wrappers_lock:
                _engine_backends[backend] = weakref.ref(wrapper)
        return wrapper
    raise TypeError(f"backend must be an lp.Engine or an lp.Backend, got {type(backend).__name__}")
