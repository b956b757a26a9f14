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

from collections.abc import Callable
from typing import NamedTuple

ROLES = ("system", "user", "assistant")
_PLACEHOLDER = "\u2063LMPROG\u2063"
_SYSTEM_PLACEHOLDER = "\u2063LMPROG-SYSTEM\u2063"
_UNREAD = object()


class RoleText(NamedTuple):
    begin: str
    end: str


class ChatRoles:
    def __init__(self, render: Callable[[list[dict[str, str]]], str]) -> None:
        self._render = render
        self._cache: dict[tuple[str, ...], RoleText] = {}
        self._default_system: object = _UNREAD

    def role_text(self, role: str, previous_roles: list[str]) -> RoleText:
        """Text before and after the content of a `role` message following `previous_roles`."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        key = (*previous_roles[-1:], role) if previous_roles else ("<first>", role)
        if key not in self._cache:
            # The previous message stands in for the whole conversation so far: the text a
            # new message adds depends on what precedes it only through the template.
            prev = [{"role": r, "content": "x"} for r in previous_roles[-1:]]
            try:
                head = self._render(prev) if prev else ""
                full = self._render(prev + [{"role": role, "content": _PLACEHOLDER}])
            except Exception as error:  # jinja raises for conversations it does not allow
                raise ValueError(
                    f"the chat template refuses a {role!r} message here: {error}"
                ) from error
            if not full.startswith(head):
                raise ValueError(
                    "the chat template rewrites earlier messages when one is added; "
                    "lmprog cannot render its roles incrementally"
                )
            tail = full[len(head) :]
            begin, sep, end = tail.partition(_PLACEHOLDER)
            if not sep:
                raise ValueError(f"the chat template drops the content of {role!r} messages")
            self._cache[key] = RoleText(begin, end)
        return self._cache[key]

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
