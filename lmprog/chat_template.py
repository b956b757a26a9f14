"""Chat roles rendered with the tokenizer's own chat template.

A program writes roles one at a time (`s += lp.user(...)`), but chat templates render a
whole conversation. The text that opens and closes each role is therefore read off the
template itself: render the conversation so far, then again with one more message whose
content is a placeholder, and split the difference at the placeholder. This keeps
everything the template does, including a default system prompt it inserts when the
conversation does not start with one. That prompt is read off the template the same way
(`ChatRoles.default_system_prompt`), so `messages()` lists it, as SGLang's does.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

ROLES = ("system", "user", "assistant")
_PLACEHOLDER = "\u2063LMPROG\u2063"
_SYSTEM_PLACEHOLDER = "\u2063LMPROG-SYSTEM\u2063"


def _slot(i: int) -> str:
    """The placeholder content of the conversation's `i`-th earlier message."""
    return f"\u2063LMPROG-{i}\u2063"


# Whole-conversation reads kept (a template that checks the whole conversation is read at
# each length where a window does not stand in for it: a 2,000-turn chat held 4 million
# key entries, 51 MiB).
MAX_WHOLE_KEYS = 256
# Earlier messages a window of such a conversation keeps (after a first system message),
# one more where that keeps its place in the alternation of roles.
WINDOW = 2
_SLOTS = re.compile("\u2063LMPROG-[0-9-]+\u2063")  # (`_slot`'s placeholders)
_UNREAD = object()


def _later_system(roles: Sequence[str]) -> bool:
    """Whether the last of `roles` is a system message after the first message: alone, it
    would read as a first one (Llama 2's, written into the next user turn)."""
    return len(roles) > 1 and roles[-1] == "system"


def _window(roles: Sequence[str]) -> tuple[str, ...]:
    """The last `WINDOW` (or one more) of `roles`, after the first where it is a system
    message: an even number of messages dropped, so roles alternating from the first go on
    alternating from the window's first."""
    lead = 1 if roles and roles[0] == "system" else 0
    keep = WINDOW + (len(roles) - lead - WINDOW) % 2
    if len(roles) - lead <= keep or "system" in roles[lead:]:  # (its place matters)
        return tuple(roles)
    return (*roles[:lead], *roles[-keep:])


class RoleText(NamedTuple):
    begin: str
    end: str


class ChatRoles:
    def __init__(
        self,
        render: Callable[[list[dict[str, str]]], str],
        render_prompt: Callable[[list[dict[str, str]]], str] | None = None,
        trailers: Iterable[str] = (),
    ) -> None:
        """`render`: the template over messages; `render_prompt` (optional): the same with
        the generation prompt (`add_generation_prompt=True`); `trailers`: the tokenizer's
        special tokens, which a template may write after a conversation's last message."""
        self._render_whole = render
        self._render_prompt = render_prompt
        self._trailers = sorted({t for t in trailers if t}, key=len, reverse=True)
        self._trailer: str | None = None  # read at first use
        self._cache: dict[tuple[str, ...], RoleText] = {}
        self._whole: set[tuple[str, ...]] = set()  # short keys whose read the template refused
        # Whole conversations' role reads (keys as long as they are), oldest use first
        self._whole_cache: OrderedDict[tuple[str, ...], RoleText] = OrderedDict()
        self._whole_lock = threading.Lock()
        self._windows_hold = True  # (until a window reads otherwise than the whole)
        self._default_system: object = _UNREAD

    def role_text(self, role: str, previous_roles: Sequence[str]) -> RoleText:
        """Text before and after the content of a `role` message following `previous_roles`."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        key = (*previous_roles[-1:], role) if previous_roles else ("<first>", role)
        text = self._cache.get(key)
        if text is not None and not _later_system(previous_roles):
            return text
        if key not in self._whole and not _later_system(previous_roles):
            try:
                # The previous message stands in for the whole conversation so far: the text
                # a new message adds depends on what precedes it only through the template.
                text = self._cache[key] = self._read(previous_roles[-1:], role)
                return text
            except ValueError:
                if len(previous_roles) < 2:
                    raise
                self._whole.add(key)  # (not tried again: it fails the same way)
        # A template that checks the whole conversation (roles alternating from a first
        # user message, as Mistral's and Llama 2's): its last messages from one at the same
        # place in the alternation stand in for it, the first time checked against a
        # render of all of it (rendered whole at each turn, a turn took time in proportion
        # to the conversation's length). Where a window reads otherwise, render all of it.
        window = ("<window>", *_window(previous_roles), role) if self._windows_hold else None
        whole = (*previous_roles, role)  # (a window's key is not a whole's: it stands in)
        with self._whole_lock:  # (programs of a batch read roles on their own threads)
            for cached in (window, whole):
                text = self._whole_cache.get(cached) if cached is not None else None
                if text is not None:
                    self._whole_cache.move_to_end(cached)
                    return text
        text = self._read(previous_roles, role)
        key = whole
        if window is not None and window[1:] != whole:
            try:
                held = self._read(window[1:-1], role) == text
            except ValueError:
                held = False
            if held:
                key = window
            else:
                self._windows_hold = False
        with self._whole_lock:
            self._whole_cache[key] = text
            while len(self._whole_cache) > MAX_WHOLE_KEYS:
                self._whole_cache.popitem(last=False)
        return text

    def trailer(self) -> str:
        """What the template writes after the last message of a conversation, whatever it
        is, and not when prompting generation: Phi-3's end of text. No role's text holds it
        (a prompt never ends a conversation), so renders are read without it."""
        if self._trailer is None:
            self._trailer = self._read_trailer()
        return self._trailer

    def _read_trailer(self) -> str:
        if self._render_prompt is None:
            return ""
        user = [{"role": "user", "content": _PLACEHOLDER}]
        try:
            whole, prompt = self._render_whole(user), self._render_prompt(user)
        except Exception:  # noqa: BLE001 - a template that refuses a user message alone
            return ""
        if prompt.startswith(whole):
            return ""
        for token in self._trailers:  # (a special token: a text split would cut one in two)
            if whole.endswith(token) and prompt.startswith(whole[: -len(token)]):
                return token
        return ""

    def _render(self, messages: list[dict[str, str]]) -> str:
        """The template over `messages`, without its trailer."""
        text, trailer = self._render_whole(messages), self.trailer()
        return text[: -len(trailer)] if trailer and text.endswith(trailer) else text

    def _read(self, previous_roles: Sequence[str], role: str) -> RoleText:
        """A message's role text, read off renders of the previous messages (placeholders
        for contents) with and without it. A message whose content the template writes
        only once another follows (Llama 2 folds the system message into the first user
        turn) is read with a user message after it, and ends with no text of its own: the
        next message's begin holds what comes between."""
        prev = [{"role": r, "content": _slot(i)} for i, r in enumerate(previous_roles)]
        new = {"role": role, "content": _PLACEHOLDER}
        follow = {"role": "assistant" if role == "user" else "user", "content": _slot(-1)}
        try:
            full = self._render([*prev, new])
            is_followed = _PLACEHOLDER not in full
            if is_followed:
                full = self._render([*prev, new, follow])
        except Exception as error:  # jinja raises for conversations it does not allow
            raise ValueError(
                f"the chat template refuses a {role!r} message here: {error}"
            ) from error
        if _PLACEHOLDER not in full:
            raise ValueError(f"the chat template drops the content of {role!r} messages")
        head = ""
        if prev:
            head = self._head(prev, full)
            if not full.startswith(head):
                raise ValueError(
                    "the chat template rewrites earlier messages when one is added; "
                    "lmprog cannot render its roles incrementally"
                )
        begin, _, end = full[len(head) :].partition(_PLACEHOLDER)
        if any(_slot(i) in begin for i in range(len(prev))):
            raise ValueError("the chat template moves earlier messages after a new one")
        if role == "assistant":
            prompt = self._generation_prompt(prev, head)
            if prompt is not None and begin.startswith(prompt):
                # A template that gives the last assistant message more text than an
                # earlier one (Qwen3's empty think block, which turns thinking off): the
                # turn begins as transformers prompts generation, as earlier turns do.
                begin = prompt
        return RoleText(begin, "" if is_followed else end)

    def _generation_prompt(self, prev: list[dict[str, str]], head: str) -> str | None:
        """What the template writes to prompt an assistant turn after `prev`, as transformers
        prompts generation (`add_generation_prompt=True`); None where it writes none. (One
        that adds to the message's begin, DeepSeek-R1's `<think>`, is not taken: a few-shot
        turn written with it would differ from the template's render of that turn.)"""
        if self._render_prompt is None or not prev:
            return None
        try:
            prompt = self._render_prompt(prev)
        except Exception:  # noqa: BLE001 - the begin read off the message stands
            return None
        return prompt[len(head) :] if prompt.startswith(head) and len(prompt) > len(head) else None

    def _head(self, prev: list[dict[str, str]], full: str) -> str:
        """The text of the conversation `prev` as its roles wrote it, within `full`: its own
        render; or, where that writes its last message otherwise (Qwen3 gives the last
        assistant message a think block), `full` up to the end of that message, its end
        text the same; or, where the render leaves out a content (written once a message
        follows), `full` up to the end of the last content."""
        try:
            alone = self._render(prev)
        except Exception:  # noqa: BLE001 - read off `full` below
            alone = ""
        last = prev[-1]["content"]
        cut = full.find(last) + len(last)
        # (one scan of the render for the slots it holds: a search for each was quadratic
        # in a whole conversation's length, read once a turn)
        if {m["content"] for m in prev} <= set(_SLOTS.findall(alone)):
            if full.startswith(alone):
                return alone
            end = alone[alone.rfind(last) + len(last) :]
            return full[:cut] + end if cut >= len(last) and full.startswith(end, cut) else alone
        return full[:cut] if cut >= len(last) else alone

    def default_system_prompt(self) -> str | None:
        """The system message the template writes when a conversation starts without one
        (None if it writes none): a user message alone, rendered, holds it where the same
        message after a system message of a placeholder holds the placeholder."""
        if self._default_system is _UNREAD:
            self._default_system = self._read_default_system()
        return self._default_system  # type: ignore[return-value]

    def _read_default_system(self) -> str | None:
        user = {"role": "user", "content": _PLACEHOLDER}
        try:
            alone = self._render([user]).partition(_PLACEHOLDER)[0]
            system = {"role": "system", "content": _SYSTEM_PLACEHOLDER}
            with_system = self._render([system, user]).partition(_PLACEHOLDER)[0]
        except Exception:  # noqa: BLE001 - a template without system messages has no default
            return None
        before, sep, after = with_system.partition(_SYSTEM_PLACEHOLDER)
        fits = len(alone) >= len(before) + len(after)
        if not sep or not fits or not alone.startswith(before) or not alone.endswith(after):
            return None
        return alone[len(before) : len(alone) - len(after)] or None
