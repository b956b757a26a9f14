"""Cache-aware order: each row's prompt prefix, computed without running the program.

The program is traced once with every argument symbolic (`Function.trace`); its leading
nodes up to the first generated value (text, roles, arguments) are its prompt template.
A row's prefix is that template with the row's values in the argument slots, so rows whose
prompts start alike sort next to each other, and run together while the radix cache holds
what they share. Roles are written as fixed markers rather than through a chat template:
every row gets the same ones, so equal prefixes stay equal and no model is needed (Ray
workers compute keys without an engine). Where the trace cannot see how an argument enters
the prompt (an f-string on it, a `.strip()`), the key goes on with the argument values
themselves, in parameter order.

`route_key` compresses a prefix for distributed sorting: one short hash per piece (each
constant text and each argument value, longer ones cut into `ROUTE_BLOCK_CHARS` blocks),
so rows sharing their first k pieces share the key's first k hashes and sort together,
then a hash of the whole prefix, so a group larger than one worker's share can still be
split between workers (Ray's sort cuts balanced key ranges).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import TYPE_CHECKING, Any

from lmprog.ir import Argument, RoleBegin, RoleEnd, Text

if TYPE_CHECKING:
    from lmprog.function import Function

ROUTE_BLOCK_CHARS = 256
ROUTE_MAX_BLOCKS = 32  # a key covers the first 8,192 characters block by block


class PrefixTemplate:
    """A program's prompt template: `prefix(arguments)` is a row's prompt prefix."""

    def __init__(self, fn: Function) -> None:
        self.params = program_params(fn)
        self._defaults = {p.name: p.default for p in self.params if p.default is not p.empty}
        self.nodes: list[Any] = []
        self.is_complete = False  # the template reaches the first generated value
        try:
            traced = fn.trace(**{p.name: Argument(p.name) for p in self.params})
        except Exception:  # noqa: BLE001 - a program that cannot be traced is run unsorted
            return
        for _, node in traced.stream(()):
            if not isinstance(node, (Text, RoleBegin, RoleEnd, Argument)):
                self.is_complete = True
                break
            self.nodes.append(node)

    def prefix(self, arguments: dict[str, Any]) -> str:
        """The row's prompt prefix (roles as markers), with its arguments substituted."""
        return "".join(self.pieces(arguments))

    def pieces(self, arguments: dict[str, Any]) -> list[str]:
        """The prefix as its template's pieces: constant texts and argument values."""
        parts = []
        for node in self.nodes:
            if isinstance(node, Text):
                parts.append(node.value)
            elif isinstance(node, RoleBegin):
                parts.append(f"\x02{node.role}\x03")
            elif isinstance(node, RoleEnd):
                parts.append("\x04")
            else:
                parts.append(str(self._value(arguments, node.name)))
        if not self.is_complete:
            parts += ["\x00" + str(self._value(arguments, p.name)) for p in self.params]
        return parts

    def _value(self, arguments: dict[str, Any], name: str) -> Any:
        return arguments.get(name, self._defaults.get(name, ""))


def program_params(fn: Function) -> list[inspect.Parameter]:
    """The program's parameters a row can fill: named ones after `s`, not bound."""
    params = list(inspect.signature(fn.func).parameters.values())[1:]
    return [
        p
        for p in params
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in fn.bound
    ]


def route_key(pieces: list[str]) -> str:
    """A sort key for a prefix given as pieces: their hashes (shared pieces, shared key
    start; 8 hex characters per piece of up to 256 characters, the first 8,192 characters
    at most), then the whole prefix's hash."""
    blocks: list[str] = []
    for piece in pieces:
        blocks += [
            piece[i : i + ROUTE_BLOCK_CHARS] for i in range(0, len(piece), ROUTE_BLOCK_CHARS)
        ]
    covered, hashes = 0, []
    for block in blocks:
        if covered >= ROUTE_BLOCK_CHARS * ROUTE_MAX_BLOCKS:
            break
        hashes.append(_hash(block, 4))
        covered += len(block)
    return "".join(hashes) + "/" + _hash("".join(pieces), 8)


def _hash(text: str, num_bytes: int) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=num_bytes).hexdigest()
