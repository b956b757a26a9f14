"""Checks of an IR node that need no model: run when a node is appended or traced, so a
bad regex or JSON schema is a ValueError at the line that wrote it."""

from __future__ import annotations

import functools
import json
import re
import warnings

from lmprog.ir import Expr, Gen


def check_static(node: Expr) -> None:
    """Errors a node has before any request: an invalid regex or JSON schema."""
    if isinstance(node, Gen):
        if node.regex is not None:
            error = _regex_error(node.regex)
            if error is not None:
                raise ValueError(f"gen {node.name!r} has an invalid regex {node.regex!r}: {error}")
        if node.json_schema is not None:
            error = _schema_error(node.json_schema)
            if error is not None:
                raise ValueError(f"gen {node.name!r} has an invalid JSON schema: {error}")


@functools.lru_cache(maxsize=256)  # (a dataset run appends the same pattern for every row)
def _regex_error(regex: str) -> str | None:
    """Why the runtime would refuse `regex` as a pattern, as Python's `re` reads it (outputs
    `re.fullmatch` it); None if it would not. (It once asked interegular, the jump-forward
    FSM's reader, which refuses what the runtime serves without jump-forward: `$`,
    `\\u00e9`, `[\\u0400-\\u04FF]`, and took `a{2,1}`.)"""
    from lmprog_runtime.constrained.outlines_backend import rust_only_class_syntax

    try:
        with warnings.catch_warnings():  # (re's FutureWarning on `[[`: refused below)
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(regex)
    except re.error as error:
        return f"Python's re refuses it: {error}"
    dialect = rust_only_class_syntax(regex)
    if dialect is not None:
        return f"{dialect!r} in a character class is Rust's syntax, which re reads otherwise"
    return None


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str) -> str | None:
    """Why the runtime would refuse `schema` (JSON text), read by its own translation to a
    regex (unknown types, keywords it cannot enforce); None if it would not."""
    from lmprog_runtime.constrained.json_schema import schema_to_regex

    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        return str(error)
    if not isinstance(parsed, (dict, bool)):
        return "a JSON schema must be an object or a bool"
    try:
        schema_to_regex(schema)
    except ValueError as error:
        return str(error)
    return None
