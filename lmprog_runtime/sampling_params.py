"""Per-request sampling parameters, validated when a request is submitted.

Validation happens in the caller's thread, so bad input raises `ValueError` at once and
never reaches the engine loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from lmprog_runtime.stop_strings import StopStrings

DEFAULT_MAX_NEW_TOKENS = 128
# `max_new_tokens=None`: generation ends at the context length (a request is cut there).
NO_LIMIT = 1 << 30
# Every float-valued parameter; each must be a finite number.
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty")


# Temperatures below this draw greedily (SGLang's threshold).
GREEDY_TEMPERATURE = 1e-6


@dataclass
class SamplingParams:
    """What to generate and when to stop (the keys of `sampling_params` in `Engine.generate`).

    Example:
        >>> SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0}).is_greedy
        True
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Generation also stops where the output first matches one of these (`re.search`); the
    # text is cut before the match, as before a stop string.
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # The request fails with TimeoutError this many seconds after it was submitted (checked
    # between steps); its slots are freed. None: no deadline.
    timeout_s: float | None = None
    # Constrained decoding: the output must fully match `regex`, or be a JSON document valid
    # against `json_schema` (JSON text). At most one of the two.
    regex: str | None = None
    json_schema: str | None = None
    # With regex / json_schema: where the output so far fully matches, the model may draw
    # any token, and one the pattern cannot take ends the output there, not kept (as
    # guidance's gens end: "Age: " + [0-9]{1,3} gives "25" where the model goes on with a
    # newline). False: only EOS ends a complete match (outlines' and SGLang's rule).
    end_outside_pattern: bool = False
    # Token healing (`token_healing.py`): back the prompt's last token up and let the first
    # token be any that begins with its text (and goes on into `regex` / `json_schema`);
    # the text returned starts after it.
    token_healing: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return dataclasses.replace(params)
        if not isinstance(params, dict):
            raise TypeError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; known ones are {sorted(known)}"
            )
        values = {k: v for k, v in params.items() if v is not None}
        if "max_new_tokens" in params and params["max_new_tokens"] is None:
            values["max_new_tokens"] = NO_LIMIT  # (as SGLang has it: up to the context)
        for name in ("stop", "stop_regex"):
            if isinstance(values.get(name), str):
                values[name] = [values[name]]
            elif isinstance(values.get(name), tuple):  # (SGLang's own default is `()`)
                values[name] = list(values[name])
        ids = values.get("stop_token_ids")
        if isinstance(ids, int):
            values["stop_token_ids"] = [ids]
        elif isinstance(ids, (tuple, range, set, frozenset)):  # (not an iterator: used up)
            values["stop_token_ids"] = list(ids)
        out = cls(**values)
        out.validate()
        return out

    def validate(self) -> None:
        def check_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")

        check_int("max_new_tokens", self.max_new_tokens)
        check_int("min_new_tokens", self.min_new_tokens)
        check_int("top_k", self.top_k)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        for name in FLOAT_PARAMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            # nan compares false with every bound below and inf turns the logits into nan,
            # so either would pass the range checks and fail a whole step in the sampler.
            if not _is_finite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for text in self.stop:  # (one never matches: outputs are UTF-8)
            check_text(text, "a stop string")
        if not isinstance(self.stop_regex, list) or not all(
            isinstance(s, str) for s in self.stop_regex
        ):
            raise TypeError("stop_regex must be a string or a list of strings")
        for pattern in self.stop_regex:
            check_text(pattern, "a stop_regex")  # (it never matched)
            try:
                compiled = re.compile(pattern)
            except re.error as error:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {error}") from error
            if compiled.search(""):
                raise ValueError(f"stop_regex {pattern!r} matches the empty string")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):  # (an iterator was used up by this check: nothing was left to stop on)
            raise TypeError("stop_token_ids must be an int or a list of ints")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # (torch's range)
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.timeout_s is not None:
            value = self.timeout_s
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"timeout_s must be a number, got {type(value).__name__}")
            if not _is_finite(value) or value <= 0:
                raise ValueError(f"timeout_s must be a finite number > 0, got {value!r}")
        for name in ("regex", "json_schema"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("pass at most one of regex and json_schema")
        for name in ("ignore_eos", "skip_special_tokens", "end_outside_pattern", "token_healing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.json_schema is not None:
            import json

            try:
                json.loads(self.json_schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"json_schema is not valid JSON: {error}") from error
            except RecursionError:  # (Python's parser, past about a thousand levels)
                raise ValueError(
                    "json_schema nests objects and lists over a thousand deep"
                ) from None

    @functools.cached_property
    def stop_strings(self) -> StopStrings:
        """`stop` ready to be searched (built once for the requests that share these
        parameters)."""
        return StopStrings(self.stop)

    @property
    def is_greedy(self) -> bool:
        """Greedy: top_k 1, or a temperature below `GREEDY_TEMPERATURE` (dividing the
        logits by 1e-38 overflowed float32, and the draw failed)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        return None

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _is_finite(value: int | float) -> bool:
    """Whether `value` is a finite float; an int too large for a float is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_text(text: str, name: str) -> None:
    """ValueError naming `name` if `text` holds a lone surrogate (`"\\ud800"`, from a
    mis-decoded file or a JSON escape): no UTF-8 holds one, and the tokenizer's own error
    was a TypeError about its input types."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise ValueError(
            f"{name} holds a lone surrogate (U+{code:04X} at index {error.start}), which is "
            "not text: no UTF-8 holds one"
        ) from None
