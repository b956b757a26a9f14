"""What the engine refuses of a constraint, told without a vocabulary or a compile: the
frontend asks (`EngineBackend.check_constraint`) when a gen is appended, so a program's
bad pattern fails at the line that wrote it, before any request."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=256)  # (a dataset run appends the same pattern for every row)
def _error(kind: str, pattern: str) -> str | None:
    from lmprog_runtime.constrained.json_schema import schema_to_regex
    from lmprog_runtime.constrained.outlines_backend import engine_regex

    try:
        engine_regex(pattern if kind == "regex" else schema_to_regex(pattern))
    except ValueError as error:
        return str(error)
    return None


def check_constraint(kind: str, pattern: str) -> None:
    """ValueError if the engine would refuse `pattern` (`kind` "regex", or "json_schema"
    as JSON text) for what it says, not what compiling it over a vocabulary finds."""
    if kind not in ("regex", "json_schema"):
        raise ValueError(f"kind must be 'regex' or 'json_schema', got {kind!r}")
    error = _error(kind, pattern)
    if error is not None:
        raise ValueError(error)
