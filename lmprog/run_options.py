"""The keywords of `run`, `run_batch` and `map` (and the CLI's `--set`): which are gen
defaults and which the program's arguments, checked before anything runs."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from lmprog.ops import REQUEST_KEYS, SAMPLING_KEYS

# run(...) keywords that set program-level defaults for every gen (gen arguments left None).
_RUN_DEFAULTS = {
    **{k: k for k in SAMPLING_KEYS},
    **{k: k for k in REQUEST_KEYS},
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
}
# SGLang's run options that do not apply in-process.
_RUN_IGNORED = ("use_thread",)
# run_batch(num_threads="auto"): enough programs in flight to fill the runtime's batches.
AUTO_THREADS = 128


def check_flag(name: str, value: Any, none_ok: bool = False) -> None:
    """TypeError naming `name` for a value that is no bool ("no" was taken as True)."""
    if not isinstance(value, bool) and not (none_ok and value is None):
        allowed = "a bool or None" if none_ok else "a bool"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")


def check_num_threads(num_threads: Any) -> int:
    """`num_threads` of `run_batch` and `map` as a count: TypeError for a value that is no
    int or `"auto"` (1.5, `"8"`, True), ValueError for an int below 1."""
    if num_threads == "auto":
        return AUTO_THREADS
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(
            f"num_threads must be a positive int or 'auto', got {type(num_threads).__name__} "
            f"{num_threads!r}"
        )
    if num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or 'auto', got {num_threads!r}")
    return num_threads


def split_kwargs(
    kwargs: dict[str, Any], program_args: Collection[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(gen defaults, the program's arguments): a keyword naming one of `program_args` is
    the program's, whatever it is called."""
    from lmprog.api import gen

    defaults, arguments, given = {}, {}, {}
    for key, value in kwargs.items():
        if key in program_args:
            arguments[key] = value
        elif key in _RUN_DEFAULTS:
            name = _RUN_DEFAULTS[key]
            if type(value).__module__ == "numpy" and hasattr(value, "item"):
                value = value.item()  # (a numpy scalar, as `np.int64(3)`, was accepted)
            try:  # checked as gen checks its own (`return_logprob="no"` once turned it on)
                gen("default", **{name: value})
            except (TypeError, ValueError) as error:  # (named as given: max_new_tokens)
                raise type(error)(str(error).replace(name, key, 1)) from None
            defaults[name], given[name] = value, key
        elif key not in _RUN_IGNORED:
            arguments[key] = value
    try:
        gen("default", **defaults)  # (min_tokens <= max_tokens)
    except ValueError as error:
        message = str(error)
        for name in ("min_tokens", "max_tokens"):
            message = message.replace(f"{name} (", f"{given.get(name, name)} (")
        raise ValueError(message) from None
    return defaults, arguments
