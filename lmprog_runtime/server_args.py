"""SGLang's server-argument names, for an engine that runs in this process.

An SGLang program makes its backend with `sgl.Runtime(model_path=..., **server_args)` (a
server process) or `sgl.Engine(...)` (in process); lmprog's `Engine` and `Runtime` take
the same names, so that line ports too:

- renamed: `context_length` (`context_len`), `mem_fraction_static` (`mem_fraction`: here the
  share of the memory free after the weights that the KV pool takes), and
  `num_continuous_decode_steps` (`decode_steps`);
- `disable_overlap_schedule=True` is `overlap_schedule=False` (False leaves the default);
- server-only settings with nothing to do in a process (`host`, `port`, `log_level`, ...)
  are accepted and have no effect;
- `tp_size`, `dp_size`, `pp_size`, `ep_size` and `nnodes` other than 1 are refused (one engine
  runs on one device), as is a `tokenizer_path` other than the model's.

The names lmprog shares with SGLang (`dtype`, `device`, `quantization`,
`max_running_requests`, `max_total_tokens`, `chunked_prefill_size`, `max_prefill_tokens`,
`schedule_policy`, `schedule_conservativeness`, `page_size`, `random_seed`,
`disable_radix_cache`, `disable_cuda_graph`, `attention_backend`) pass as they are; any
other name is an unknown argument (`TypeError`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

RENAMED = {
    "context_length": "context_len",
    "mem_fraction_static": "mem_fraction",
    "num_continuous_decode_steps": "decode_steps",
}
NO_EFFECT = frozenset(
    {
        "host",
        "port",
        "log_level",
        "log_level_http",
        "log_requests",
        "show_time_cost",
        "trust_remote_code",
        "served_model_name",
        "skip_server_warmup",
        "api_key",
        "enable_metrics",
        "stream_interval",
    }
)
ONE_DEVICE = ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes")


def from_sglang(model_path: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with SGLang's server-argument names translated to lmprog's (see the module
    docstring). Raises ValueError for a setting one in-process engine cannot honour, and
    TypeError for a setting given under both names.

    Example:
        >>> from_sglang("tiny", {"context_length": 512, "port": 30000})
        {'context_len': 512}
    """
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # lmprog's name -> the name it was given as
    for name, value in fields.items():
        if name in NO_EFFECT:
            continue
        if name in ONE_DEVICE:
            if value not in (None, 1):
                raise ValueError(
                    f"{name}={value!r}: an lmprog engine runs on one device in this process"
                )
            continue
        if name == "tokenizer_path":
            if value is not None and str(value) != str(model_path):
                raise ValueError(
                    f"tokenizer_path={value!r}: lmprog reads the tokenizer with the model "
                    f"({model_path!r})"
                )
            continue
        if name == "disable_overlap_schedule":
            if value:
                _put(out, given, "overlap_schedule", False, name)
            continue
        _put(out, given, RENAMED.get(name, name), value, name)
    return out


def _put(out: dict[str, Any], given: dict[str, str], target: str, value: Any, name: str) -> None:
    if target in out:
        raise TypeError(f"{given[target]} and {name} set the same thing: give one of them")
    out[target], given[target] = value, name


@contextlib.contextmanager
def named_as_given(names: Iterable[str]) -> Iterator[None]:
    """A TypeError or ValueError raised inside, said with the settings' names as given
    (`as_given`)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        said = as_given(str(error), names)
        if said == str(error) or type(error) not in (TypeError, ValueError):
            raise  # (a subclass may take other arguments than a message)
        raise type(error)(said) from None


def as_given(message: str, names: Iterable[str]) -> str:
    """A settings error's `message` naming each renamed setting as it was given (one given
    as `mem_fraction_static` read `mem_fraction must be in (0, 1)`)."""
    for sglang_name, name in RENAMED.items():
        if sglang_name in names:
            message = re.sub(rf"\b{name}\b", sglang_name, message)
    return message
