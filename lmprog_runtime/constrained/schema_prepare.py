"""A JSON schema made ready for outlines-core's regex translation (`json_schema.py`):
what it would translate into documents that do not validate is refused, named, or
rewritten into a narrower schema every output of which validates.

- `allOf` of one schema (pydantic's wrapper of a `$ref` with a description) becomes that
  schema; of several, it is refused (the translation writes one object after another).
- `oneOf` is refused unless it has a `discriminator` (pydantic's tagged unions, whose
  branches cannot both match): the translation treats it as `anyOf`, so an output valid
  under two branches could come out. `anyOf` says the same where that is meant.
- Property names that JSON must escape (a quote, a backslash, a control character),
  required properties with no schema under `properties`, and recursive `$ref`s (cut off
  at an empty object) are refused; so are empty lists of alternatives (`enum`, `anyOf`,
  `oneOf`, `type`), which no value satisfies.
- A string's `pattern` and `format` are written as `string_patterns.py` says.
- A constraint the translation drops for the keyword beside it is refused: anything but
  annotations (and `type` for an `enum` / `const`) next to `enum`, `const`, `$ref`,
  `anyOf` or `oneOf`, a `minLength` / `maxLength` next to a `pattern` or `format` that
  would bind (one every value fits is dropped; a `uri`'s is met by a bounded pattern), and
  `prefixItems` with item counts it does not hold (it writes exactly the prefix items).
  An `enum` is narrowed to the values of its `type`.
- A schema of any value (`{}`, `true`, annotations only) becomes scalars, or arrays and
  objects of values nested `ANY_DEPTH` deep at most (one less inside an array's items),
  and an object or array whose members are not given (`{"type": "object"}`, pydantic's
  `dict[str, Any]`) holds such values: outlines-core wrote `{}` as bare alternatives,
  which spilled out of a property, and its own open objects and arrays, nested three
  deep, took 2.6-3.9 s to compile over SmolLM2's vocabulary, and an array of any values
  over 60 s (refused for its time).
"""

from __future__ import annotations

from typing import Any

from lmprog_runtime.constrained.string_patterns import (
    FORMATS,
    json_safe_pattern,
    lengths_in_pattern,
)

_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, never descended into
_NAMED_SCHEMAS = ("properties", "$defs", "definitions")  # name -> schema maps
# Keywords whose value is a schema, or a list of schemas.
_SCHEMA_VALUED = frozenset(
    {"items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not"}
    | {"contains", "propertyNames", "if", "then", "else", "additionalItems"}
)
# Keywords that constrain nothing (annotations, and the schema's own identifiers).
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly"}
    | {"writeOnly", "$schema", "$id", "$anchor"}
)
# $refs nested one inside another (models inside models): outlines-core is told to follow
# this many (its default of 3 left out, silently, every property past a fifth level).
MAX_REF_DEPTH = 64
# Arrays and objects in one another that a value of any type may be (`_any_value`).
ANY_DEPTH = 2
_SCALARS = {"type": ["boolean", "null", "number", "string"]}
# Keywords that give a schema's values otherwise than its type does.
_VALUES_BY_TYPE = frozenset({"enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not"})


class SchemaError(ValueError):
    """What cannot be enforced, and where in the schema (`/properties/slug`)."""

    def __init__(self, reason: str, path: tuple[str, ...]) -> None:
        super().__init__(f"{reason} (at /{'/'.join(path)})")
        self.reason, self.path = reason, path

    @classmethod
    def at(cls, error: ValueError, *steps: str) -> SchemaError:
        """`error` one level further out: at `steps` (a keyword, a name) in the schema."""
        if isinstance(error, SchemaError):
            return cls(error.reason, (*steps, *error.path))
        return cls(str(error), steps)


def prepared(schema: Any) -> Any:
    """`schema` (parsed JSON) ready for translation (a new object); ValueError naming what
    cannot be enforced."""
    _check_no_recursion(schema)
    return _prepare(schema)


def _prepare(node: Any, is_schema: bool = True, depth: int = ANY_DEPTH) -> Any:
    """`node` prepared; `is_schema`: it stands where a schema does (not inside an
    extension keyword's value, nor a map of property names to lists); `depth`: how deep
    a value of any type there may nest."""
    if isinstance(node, list):
        return [_prepare(item, is_schema, depth) for item in node]
    if not isinstance(node, dict):
        return node
    if is_schema and set(node) <= _ANNOTATIONS:  # any value
        # (outlines-core writes `{}` as bare alternatives: as a property, `{"a": {}}`
        # matched `[1]` and refused `{"a": true}`; these alternatives are grouped)
        return {**node, **_any_value(depth)}
    node = _without_all_of(node)
    if is_schema:
        node = _with_open_members(node, depth)
    if "oneOf" in node and "discriminator" not in node:
        raise ValueError(
            "unsupported JSON schema feature 'oneOf' (exactly one branch) without a "
            "discriminator: use 'anyOf' where the branches cannot both match"
        )
    _check_properties(node)
    if is_schema:
        _check_alternatives(node)
        node = _check_siblings(node)
    form = node.get("format")
    if node.get("type") == "string" and form in FORMATS:
        if "pattern" in node:
            raise ValueError(f"unsupported JSON schema: 'format' {form!r} with a 'pattern'")
        node = {k: v for k, v in node.items() if k != "format"}
        node["pattern"] = FORMATS[form]
    out = {}
    for key, value in node.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            # (`true`, any value, as `{}`: outlines-core refused a bare `true` there)
            named = {name: {} if sub is True else sub for name, sub in value.items()}
            # (a model in `$defs` may be an array's items: as deep as those, at most)
            inner_depth = depth if key == "properties" else ANY_DEPTH - 1
            out[key] = {}
            for name, sub in named.items():
                try:
                    out[key][name] = _prepare(sub, True, inner_depth)
                except ValueError as error:  # (which property: a model has many)
                    raise SchemaError.at(error, key, name) from None
        elif key == "pattern" and isinstance(value, str):
            out[key] = json_safe_pattern(value)
        elif key in ("items", "prefixItems") and is_schema:
            # (each level of arrays doubles its items' pattern: one less deep there)
            out[key] = _prepare(_true_as_empty(value), True, min(depth, ANY_DEPTH - 1))
        else:
            inner = is_schema and key in _SCHEMA_VALUED
            # (an object's other members, as an open object's: one level less deep)
            inner_depth = depth - 1 if key == "additionalProperties" else depth
            out[key] = value if key in _NOT_SCHEMAS else _prepare(value, inner, inner_depth)
    return out


def _any_value(depth: int) -> dict:
    """A schema of any value nesting `depth` arrays or objects at most (scalars at 0)."""
    if depth <= 0:
        return dict(_SCALARS)
    inner = _any_value(depth - 1)
    return {
        "anyOf": [
            dict(_SCALARS),
            {"type": "array", "items": inner},
            {"type": "object", "additionalProperties": inner},
        ]
    }


def _with_open_members(node: dict, depth: int) -> dict:
    """An object whose members are not given (no `properties`, `additionalProperties`
    missing or true) or an array whose items are not, alone or in a list of types: its
    members any value, one level less deep (outlines-core's own, three deep, compiled for
    seconds). Not where the values are given otherwise (`enum`, `$ref`, `anyOf`, ...)."""
    if not _VALUES_BY_TYPE.isdisjoint(node):
        return node
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    open_object = "properties" not in node and "patternProperties" not in node
    if "object" in kinds and open_object and node.get("additionalProperties", True) is True:
        node = {**node, "additionalProperties": _any_value(depth - 1)}
    if "array" in kinds and "items" not in node and "prefixItems" not in node:
        node = {**node, "items": _any_value(depth - 1)}
    return node


def _true_as_empty(value: Any) -> Any:
    if isinstance(value, list):
        return [{} if item is True else item for item in value]
    return {} if value is True else value


def _without_all_of(node: dict) -> dict:
    """`node` with an `allOf` of one schema merged in (next to annotations only)."""
    if "allOf" not in node:
        return node
    branches, rest = node["allOf"], {k: v for k, v in node.items() if k != "allOf"}
    if not isinstance(branches, list) or len(branches) != 1 or not isinstance(branches[0], dict):
        raise ValueError(
            "unsupported JSON schema feature 'allOf' of several schemas: write them as one"
        )
    if set(rest) - _ANNOTATIONS:
        raise ValueError(
            f"unsupported JSON schema: 'allOf' next to {sorted(set(rest) - _ANNOTATIONS)}"
        )
    return {**rest, **branches[0]}


# Keywords next to which outlines-core's translation ignores every other constraint (it
# writes the listed values, the referenced schema, the alternatives), and those that may
# stand beside them all the same.
_ALONE = {
    "enum": _ANNOTATIONS | {"type", "enum"},
    "const": _ANNOTATIONS | {"type", "const"},
    "$ref": _ANNOTATIONS | {"$ref", "$defs", "definitions"},
    "anyOf": _ANNOTATIONS | {"anyOf", "$defs", "definitions"},
    "oneOf": _ANNOTATIONS | {"oneOf", "discriminator", "$defs", "definitions"},
}
_JSON_TYPES: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _check_siblings(node: dict) -> dict:
    """ValueError for a constraint the translation would drop for the keyword beside it
    (`{"type": "string", "minLength": 3, "enum": ["a"]}` gave "a"); an `enum` narrowed to
    the values of its `type` (`{"type": "string", "enum": ["a", 1]}` gave 1)."""
    for key, allowed in _ALONE.items():
        extra = {k for k in set(node) - allowed if not k.startswith("x-")}  # (extensions)
        if key in node and extra:
            raise ValueError(
                f"unsupported JSON schema: {sorted(extra)} next to {key!r}, "
                f"which outlines-core would enforce alone (put the constraint inside it)"
            )
    if node.get("type") == "string" and ("pattern" in node or "format" in node):
        node = lengths_in_pattern(node)
    prefix = node.get("prefixItems")
    if isinstance(prefix, list):  # (written as exactly its items)
        low, high = node.get("minItems", 0), node.get("maxItems", len(prefix))
        if not (isinstance(low, int) and isinstance(high, int) and low <= len(prefix) <= high):
            raise ValueError(
                f"unsupported JSON schema: 'prefixItems' of {len(prefix)} with 'minItems' "
                f"{low} / 'maxItems' {high} (the translation writes exactly the prefix items)"
            )
    kind = node.get("type")
    check = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
    if check is not None and "const" in node and not check(node["const"]):
        raise ValueError(f"JSON schema: 'const' {node['const']!r} is no {node['type']}")
    if check is not None and isinstance(node.get("enum"), list):
        kept = [value for value in node["enum"] if check(value)]
        if not kept:
            raise ValueError(f"JSON schema: no 'enum' value is a {node['type']}")
        node = {**node, "enum": kept}
    return node


def _check_alternatives(node: dict) -> None:
    """ValueError for a list of alternatives that is empty: no value satisfies it, and the
    translation would let the value out (`{"a": }`) or be empty."""
    for key in ("enum", "anyOf", "oneOf", "type"):
        if node.get(key) == []:
            raise ValueError(
                f"JSON schema: {key!r} is an empty list, which no value satisfies (a property "
                "with it can never be there: leave the property out)"
            )


def _check_properties(node: dict) -> None:
    properties = node.get("properties")
    names = list(properties) if isinstance(properties, dict) else []
    for name in names:
        if any(ch in '"\\' or ord(ch) < 0x20 for ch in name):
            raise ValueError(f"unsupported JSON schema: property name {name!r} needs JSON escapes")
    required = node.get("required")
    missing = [r for r in required if r not in names] if isinstance(required, list) else []
    if missing:
        raise ValueError(
            f"unsupported JSON schema: required {missing} without a schema under 'properties'"
        )


def _check_no_recursion(schema: Any) -> None:
    """ValueError for a `$ref` that leads back to a schema it is inside (`#`, `$defs`), and
    for chains of more than `MAX_REF_DEPTH` `$ref`s one inside another. Each name is
    walked once (a schema whose definitions each refer to the next twice took 2^n walks)."""
    named = {}
    if isinstance(schema, dict):
        for key in ("$defs", "definitions"):
            if isinstance(schema.get(key), dict):
                named.update({f"#/{key}/{n}": s for n, s in schema[key].items()})
    refs = {"#": _refs(schema, top=True), **{name: _refs(s) for name, s in named.items()}}
    visiting: list[str] = []
    depths: dict[str, int] = {}  # name -> the longest chain of $refs below it
    too_deep = f"unsupported JSON schema: more than {MAX_REF_DEPTH} $refs nested one in another"

    def visit(name: str) -> int:
        if name in depths:
            return depths[name]
        if name in visiting:
            raise ValueError(f"unsupported JSON schema: recursive $ref {name!r}")
        if len(visiting) > MAX_REF_DEPTH:  # (said here: a long chain would exhaust the stack)
            raise ValueError(too_deep)
        visiting.append(name)
        depth = max((1 + visit(ref) for ref in refs.get(name, ())), default=0)
        visiting.pop()
        depths[name] = depth
        return depth

    if visit("#") > MAX_REF_DEPTH:  # (a chain through a name walked before: its depth)
        raise ValueError(too_deep)


def _refs(node: Any, top: bool = False) -> set[str]:
    """The `$ref`s inside `node` (the top schema's `$defs` apart: named on their own)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                found.add(value)
            elif key in _NOT_SCHEMAS or (top and key in ("$defs", "definitions")):
                continue
            elif key in _NAMED_SCHEMAS and isinstance(value, dict):
                for sub in value.values():
                    found |= _refs(sub)
            else:
                found |= _refs(value)
    elif isinstance(node, list):
        for item in node:
            found |= _refs(item)
    return found
