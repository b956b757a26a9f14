"""Checks of an IR node that need no model: run when a node is appended or traced, so a
bad regex or JSON schema is a ValueError at the line that wrote it."""

from __future__ import annotations

import functools
import json
import re
import warnings
from typing import TYPE_CHECKING

from lmprog.ir import Expr, Gen

try:  # (Python 3.11 on; 3.10 has it as sre_parse)
    from re import _parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _parser

if TYPE_CHECKING:
    from lmprog.backend import Backend


def check_static(node: Expr, backend: Backend | None = None) -> None:
    """Errors a node has before any request: an invalid regex or JSON schema; with a
    `backend`, also what it would refuse of them (`Backend.check_constraint`)."""
    if not isinstance(node, Gen):
        return
    if node.regex is not None:
        error = _regex_error(node.regex)
        if error is not None:
            raise ValueError(f"gen {node.name!r} has an invalid regex {node.regex!r}: {error}")
    if node.json_schema is not None:
        try:
            schema = json.loads(node.json_schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"gen {node.name!r} has an invalid JSON schema: {error}") from error
        except RecursionError:  # (Python's parser, past about a thousand levels)
            raise ValueError(
                f"gen {node.name!r} has a JSON schema nested over a thousand deep"
            ) from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"gen {node.name!r}: a JSON schema must be an object or a bool")
    if backend is None:
        return
    for kind, pattern in (("regex", node.regex), ("json_schema", node.json_schema)):
        if pattern is not None:
            try:
                backend.check_constraint(kind, pattern)
            except ValueError as error:
                what = "regex" if kind == "regex" else "JSON schema"
                raise ValueError(f"gen {node.name!r} has an invalid {what}: {error}") from None


@functools.lru_cache(maxsize=256)  # (a dataset run appends the same pattern for every row)
def _regex_error(regex: str) -> str | None:
    """Why `regex` cannot constrain a gen, read as Python's `re` reads it (outputs
    `re.fullmatch` it): re refuses it, or it asks what a finite automaton cannot do;
    None if neither. (It once asked interegular, the jump-forward FSM's reader, which
    refuses what the runtime serves without jump-forward: `\\u00e9`, `[\\u0400-\\u04FF]`,
    `(?x)`, and took `a{2,1}`.)"""
    try:
        with warnings.catch_warnings():  # (re's FutureWarning on `[[`: the backend refuses it)
            warnings.simplefilter("ignore", FutureWarning)
            tree = _parser.parse(regex)
    except re.error as error:
        return f"Python's re refuses it: {error}"
    return _automaton_error(tree)


_NOT_REGULAR = {
    "GROUPREF": "a back-reference",
    "GROUPREF_EXISTS": "a conditional group",
    "ASSERT": "a lookaround",
    "ASSERT_NOT": "a lookaround",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repeat",
}
_BOUNDARIES = {"AT_BOUNDARY", "AT_NON_BOUNDARY"}


def _automaton_error(tree: object) -> str | None:
    """The first construct of a parsed pattern that a finite automaton (outlines-core's
    index) cannot follow: back-references, lookarounds, atomic groups, `\\b` `\\B`; None if
    there is none. (Where an anchor stands is the backend's check: `portable_regex`.)"""
    for op, arg in tree:  # type: ignore[attr-defined]
        name = str(op)
        if name in _NOT_REGULAR:
            return f"{_NOT_REGULAR[name]} is not a regular construct; the engine cannot follow it"
        if name == "AT" and str(arg) in _BOUNDARIES:
            return "\\b and \\B are not supported (write the text they stand for)"
        for part in arg if isinstance(arg, (tuple, list)) else ():
            children = part if isinstance(part, list) else [part]
            for child in children:
                if hasattr(child, "data"):  # a nested pattern (a group, a branch, a repeat)
                    found = _automaton_error(child)
                    if found is not None:
                        return found
    return None
