"""The primitives a program appends to its state: text generation, selection and roles.

Every sampling argument of `gen` defaults to None, meaning "inherit the program-level
default given to `run(...)`", and then the runtime's default.

Example:
    >>> @lp.function
    ... def qa(s, question):
    ...     s += lp.user(question)
    ...     s += lp.assistant(lp.gen("answer", max_tokens=32, temperature=0))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmprog.choices import ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import Concat, Expr, Gen, RoleBegin, RoleEnd, Select, as_expr

# The patterns `gen(dtype=...)` enforces (SGLang's names). Numbers are bounded by what the
# value's machine type holds (18 digits always fit int64; float64 keeps 15-17 significant
# digits), so a model that has lost track cannot write digits until `max_tokens`. One of
# NUMBER_END may follow a number: a model ends "... a day is 24" with "." or " hours", and
# with only digits or EOS allowed it writes "2400..." instead (a lone space is a rare token).
# The value read back (`s[name]`) leaves it out; the text keeps it.
NUMBER_END = " \n.,"
REGEX_INT = r"-?(0|[1-9][0-9]{0,17})[ \n.,]?"
REGEX_FLOAT = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?[ \n.,]?"
REGEX_BOOL = r"(True|False)"
# A JSON string literal: ends where the model closes the quote; escapes stay whole.
REGEX_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
    dtype: type | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
) -> Expr:
    """Generate text into variable `name` (an automatic `gen_N` when None).

    With `choices`, this is `select(name, choices, ...)`.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sampling = {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
    }
    if dtype is not None and dtype not in (int, float, bool, str):
        raise ValueError(f"dtype must be int, float, bool or str, got {dtype!r}")
    if hasattr(json_schema, "model_json_schema"):  # a pydantic model class
        json_schema = json_schema.model_json_schema()
    if isinstance(json_schema, (dict, bool)):
        import json

        json_schema = json.dumps(json_schema)
    if return_logprob:
        # Not sampling parameters: the interpreter passes them to the backend per request.
        sampling["return_logprob"] = True
        sampling["top_logprobs_num"] = top_logprobs_num or 0
    return Gen(name, sampling, regex=regex, json_schema=json_schema, dtype=dtype)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """Generate an integer (constrained decoding); `s[name]` is an int."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """Generate a JSON string literal (constrained decoding); `s[name]` is the decoded str."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Append the choice the model finds most likely (see `lmprog.choices` for methods)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
        raise TypeError("choices must be a list of strings")
    if len(set(choices)) != len(choices):
        raise ValueError(f"select has duplicate choices: {list(choices)}")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise TypeError("choices_method must be one of lp.token_length_normalized, ...")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return Select(name, tuple(choices), float(temperature), choices_method)


def _role(role: str, expr: Expr | str | None) -> Expr:
    if expr is None:
        return Concat((RoleBegin(role), RoleEnd(role)))
    return Concat((RoleBegin(role), as_expr(expr), RoleEnd(role)))


def system(expr: Expr | str | None = None) -> Expr:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def image(path: str) -> Expr:
    """Images need a multimodal model; no supported architecture has one yet."""
    raise NotImplementedError("lp.image needs a multimodal model, which lmprog does not run yet")
