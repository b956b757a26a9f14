"""About how long outlines-core's regex of a JSON schema will be, estimated before it is
built: the translation writes an array's item pattern twice (the first item, then the
others), a map's value pattern twice too, and every `$ref` out in full where it stands, so a small schema can ask for a
regex of gigabytes (22 levels of arrays in 568 characters: the process was killed for
memory). The estimate follows the same structure; its constants are the lengths of the
translation's own patterns for each kind of value, measured once.
"""

from __future__ import annotations

import json
from typing import Any

from lmprog_runtime.constrained.schema_prepare import _ANNOTATIONS

MAX_REGEX_CHARS = 2_000_000  # (a regex this long takes minutes to compile, if it fits)

_LEAF = {"string": 50, "integer": 800, "number": 100, "boolean": 12, "null": 4}
_ANY_VALUE = 13_000  # a value of any type (`{}`), nested as the translation nests it
_SEPARATOR = 20  # punctuation and whitespace around a member or an item


def estimated_size(schema: Any) -> int:
    """About how many characters the regex of `schema` (parsed, prepared) has."""
    named: dict[str, Any] = {}
    if isinstance(schema, dict):
        for key in ("$defs", "definitions"):
            if isinstance(schema.get(key), dict):
                named.update({f"#/{key}/{n}": s for n, s in schema[key].items()})
    known: dict[str, int] = {}

    def size_of_ref(ref: str) -> int:
        if ref not in known:
            known[ref] = 0  # (recursion is refused before: a loop here counts nothing)
            known[ref] = size(named[ref]) if ref in named else _ANY_VALUE
        return known[ref]

    def size(node: Any) -> int:
        if isinstance(node, bool):
            return _ANY_VALUE if node else 0
        if isinstance(node, list):  # (alternatives or prefix items)
            return sum(size(item) + _SEPARATOR for item in node)
        if not isinstance(node, dict):
            return 0
        total = 0
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                total += size_of_ref(value)
            elif key == "properties" and isinstance(value, dict):
                total += sum(len(name) + _SEPARATOR + size(sub) for name, sub in value.items())
            elif key == "items":  # (written out twice, with the punctuation around it)
                total += 2 * (size(value) + _SEPARATOR)
            elif key == "additionalProperties":  # (twice too, each with its key's pattern)
                total += 2 * (size(value) + _LEAF["string"] + 2 * _SEPARATOR)
            elif key in ("prefixItems", "anyOf", "oneOf"):
                total += size(value)
            elif key == "pattern" and isinstance(value, str):
                total += len(value) + _SEPARATOR
            elif key in ("enum", "const"):
                total += len(json.dumps(value)) + _SEPARATOR
        if total:
            return total
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if set(node) <= _ANNOTATIONS | {"type"} and (
            kind is None or "array" in kinds or "object" in kinds
        ):
            return _ANY_VALUE
        return sum(_LEAF.get(k, _ANY_VALUE) if isinstance(k, str) else _ANY_VALUE for k in kinds)

    return size(schema)
