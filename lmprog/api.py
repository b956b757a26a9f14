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

import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import NoneType
from typing import Any

from lmprog.choices import ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import (  # (REGEX_* are public here too: in `__all__`)
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    Concat,
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    as_expr,
    check_text,
)
from lmprog.run_options import check_flag

__all__ = [  # (without it a checker reads the REGEX_* imported here as private)
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "gen",
    "gen_int",
    "gen_string",
    "image",
    "select",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]

DTYPES = {"int": int, "float": float, "bool": bool, "str": str}


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: int | Sequence[int] | AbstractSet[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    token_healing: bool | None = None,
    end_outside_pattern: bool | None = None,
    timeout_s: float | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type[Any] | str | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | bool | type[Any] | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
) -> Expr:
    """Generate text into variable `name` (an automatic `gen_N` when None).

    With `choices`, this is `select(name, choices, ...)`. With `dtype` (`int`, `float`,
    `bool`, `str` or their names) the output is constrained to that type's pattern and the
    value is the generated text, as in SGLang: `int(s["n"])`. A number may end with a
    space, newline, "." or ","; that end is consumed like a stop string (it is neither in
    the text nor in the value), so "... a day is " + gen_int() + " hours" reads naturally.

    `token_healing` (None: only where the text so far ends with a space, as in
    "Name: " + gen(...)): the text's last token is backed up and the first token may be any
    that begins with its text, so the model writes " Sir" as it would, not "Sir" after a
    lone space token; the value starts after the backed-up text (a constraint's pattern
    then applies to the value).

    `end_outside_pattern` (None: True for a constrained gen): once the value fully matches
    its pattern, a token the pattern cannot take ends it (guidance's rule), so "Age: " +
    gen(regex="[0-9]{1,3}") + "\n" ends at "25" where the model goes on with a newline;
    False: only EOS ends it (SGLang's and outlines' rule).

    `timeout_s`: the request fails with TimeoutError (and so does the program) if it has
    not finished that many seconds after it was sent; `run(timeout_s=...)` sets it for
    every gen of the program (selects take no deadline).
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    constraints = {"choices": choices, "regex": regex, "json_schema": json_schema, "dtype": dtype}
    given = [key for key, value in constraints.items() if value is not None]
    if len(given) > 1:
        raise ValueError(
            f"gen takes at most one of choices, regex, json_schema and dtype, got {given}"
        )
    _check_numbers(
        ints={
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "top_k": top_k,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
        },
        floats={
            "temperature": temperature,
            "top_p": top_p,
            "min_p": min_p,
            "frequency_penalty": frequency_penalty,
            "presence_penalty": presence_penalty,
            "timeout_s": timeout_s,
        },
    )
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if min_tokens is not None and min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if None not in (min_tokens, max_tokens) and min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sampling = {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "stop_regex": stop_regex,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        "token_healing": token_healing,
        "end_outside_pattern": end_outside_pattern,
        "timeout_s": timeout_s,
        # Not sampling parameters: the interpreter passes them to the backend per request.
        # (None, as every key here: `run()`'s default, if it gives one)
        "return_logprob": return_logprob,
        "top_logprobs_num": top_logprobs_num,
        "logprob_start_len": logprob_start_len,
        "return_text_in_logprobs": return_text_in_logprobs,
    }
    if isinstance(dtype, str) and dtype in DTYPES:
        dtype = DTYPES[dtype]
    if dtype is not None and dtype not in (int, float, bool, str):
        raise ValueError(f"dtype must be int, float, bool or str (or their names), got {dtype!r}")
    flags = ("ignore_eos", "end_outside_pattern", "token_healing", "return_logprob")
    for key in (*flags, "return_text_in_logprobs"):
        check_flag(key, sampling[key], none_ok=True)
    if choices is not None:  # (the other arguments, checked above, do not apply: SGLang's)
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    if regex is not None and not isinstance(regex, str):
        raise TypeError(f"regex must be a str, got {type(regex).__name__}")
    if hasattr(json_schema, "model_json_schema"):  # a pydantic model class
        json_schema = json_schema.model_json_schema()
    if isinstance(json_schema, (dict, bool)):
        import json

        try:
            json_schema = json.dumps(json_schema)
        except (TypeError, ValueError) as error:  # (a class, a set, nan as a value...)
            raise TypeError(f"json_schema is not JSON: {error}") from None
    if json_schema is not None and not isinstance(json_schema, str):
        raise TypeError(
            "json_schema must be a dict, a str of JSON, a bool or a pydantic model class, "
            f"got {type(json_schema).__name__}"
        )
    return Gen(name, sampling, regex=regex, json_schema=json_schema, dtype=dtype)


def _check_numbers(ints: dict[str, Any], floats: dict[str, Any]) -> None:
    """TypeError naming the argument for a number of the wrong type (ranges and
    finiteness are checked with the request, by the runtime)."""
    for name, value in ints.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    for name, value in floats.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """Generate an integer (constrained decoding); `s[name]` is its text: `int(s[name])`."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """Generate a JSON string literal (constrained decoding); `s[name]` is the literal, quotes
    included, as in SGLang: `json.loads(s[name])` is the string."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float | None = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Append the choice the model finds most likely (see `lmprog.choices` for methods);
    `temperature` None is 0."""
    if isinstance(choices, (str, bytes, Mapping)) or not isinstance(choices, (Iterable, NoneType)):
        raise TypeError(f"choices must be a list of strings, got {type(choices).__name__}")
    choices = None if choices is None else list(choices)  # (a generator is read once)
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) for c in choices):
        raise TypeError("choices must be a list of strings")
    if "" in choices:  # (no token of its own to score: the prompt's last one stood in)
        raise ValueError(
            "choices must be non-empty strings: an empty choice has no tokens to score; "
            "put the text the choices share after the select"
        )
    if len(set(choices)) != len(choices):
        raise ValueError(f"select has duplicate choices: {list(choices)}")
    for choice in choices:
        check_text(choice, "a select choice")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise TypeError(
            "choices_method must be lp.token_length_normalized, lp.greedy_token_selection, "
            "lp.unconditional_likelihood_normalized or a lmprog.choices.ChoicesSamplingMethod "
            f"subclass instance, got {type(choices_method).__name__}"
        )
    if not choices_method.is_sglang_style and (
        type(choices_method).decide is ChoicesSamplingMethod.decide
    ):
        raise TypeError(
            f"choices_method {type(choices_method).__name__} implements neither decide(...) "
            "nor SGLang's __call__(*, choices, normalized_prompt_logprobs, ...)"
        )
    temperature = 0.0 if temperature is None else temperature
    _check_numbers(ints={}, floats={"temperature": temperature})
    if not 0 <= temperature < math.inf:  # (nan fails it too)
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if temperature > 0 and choices_method.is_sglang_style:
        raise ValueError(
            f"choices_method {choices_method.label} decides by its own __call__: "
            "a select with it takes temperature 0 (as SGLang's)"
        )
    return Select(name, tuple(choices), float(temperature), choices_method)


def role_expr(role: str, expr: Expr | str | None) -> Expr:
    """A whole message of `role`: begin, `expr` (or nothing), end."""
    if expr is None:
        return Concat((RoleBegin(role), RoleEnd(role)))
    return Concat((RoleBegin(role), as_expr(expr), RoleEnd(role)))


def system(expr: Expr | str | None = None) -> Expr:
    return role_expr("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return role_expr("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return role_expr("assistant", expr)


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
