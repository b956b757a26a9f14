"""lmprog: write structured LLM programs in Python and run them on an in-process runtime.

    import lmprog as lp

    @lp.function
    def triage(s, question):
        s += lp.user(question)
        s += lp.assistant("Category: " + lp.select("cat", choices=["refund", "shipping"]))

    lp.set_default_backend(lp.Engine())
    state = triage.run(question="My parcel is late")

The frontend never touches tensors; `lmprog.Engine` (the runtime) is imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmprog.api import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from lmprog.backend import (
    Backend,
    EngineBackend,
    flush_cache,
    get_default_backend,
    set_default_backend,
)
from lmprog.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from lmprog.display import to_dataframe
from lmprog.function import Function, function
from lmprog.ir import Expr
from lmprog.state import ProgramCancelled, ProgramState, ProgramStateGroup

__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Backend",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Engine",
    "EngineBackend",
    "Expr",
    "Function",
    "ProgramCancelled",
    "ProgramState",
    "ProgramStateGroup",
    "QueueFull",
    "RequestAborted",
    "Runtime",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "default_model_path",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "to_dataframe",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]


if TYPE_CHECKING:  # (imported lazily below: these names for type checkers)
    from lmprog_runtime import (
        Engine,
        QueueFull,
        RequestAborted,
        Runtime,
        default_model_path,
    )


if not TYPE_CHECKING:  # (seen by a checker, it typed every name `Any`: `lp.usr` passed)

    def __getattr__(name: str) -> Any:
        if name in ("Engine", "QueueFull", "RequestAborted", "Runtime", "default_model_path"):
            import lmprog_runtime

            return getattr(lmprog_runtime, name)
        raise AttributeError(f"module 'lmprog' has no attribute {name!r}")
