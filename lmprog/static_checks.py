"""Checks of an IR node that need no model: run when a node is appended or traced, so a
bad regex or JSON schema is a ValueError at the line that wrote it."""

from __future__ import annotations

import json

from lmprog.ir import Expr, Gen


def check_static(node: Expr) -> None:
    """Errors a node has before any request: an invalid regex or JSON schema."""
    if isinstance(node, Gen):
        if node.regex is not None:
            try:
                import interegular

                interegular.parse_pattern(node.regex)
            except Exception as error:
                # (interegular's errors may have no message: name the error then)
                reason = str(error) or type(error).__name__
                raise ValueError(
                    f"gen {node.name!r} has an invalid regex {node.regex!r}: {reason}"
                ) from error
        if node.json_schema is not None:
            try:
                schema = json.loads(node.json_schema)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"gen {node.name!r} has an invalid JSON schema: {error}"
                ) from error
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"gen {node.name!r}: a JSON schema must be an object or a bool")
