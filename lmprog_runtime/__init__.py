"""lmprog_runtime: the in-process runtime (engine, scheduler, KV cache, models, kernels).

It knows nothing about programs; the `lmprog` frontend talks to it through a narrow backend
interface. Importing this package imports torch but never Triton and compiles nothing.
"""

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.engine import Engine, Runtime
from lmprog_runtime.models import (
    default_model_path,
    local_model_dir,
    named_models,
    notebook_model,
    resolve_model_path,
)
from lmprog_runtime.results import QueueFull, RequestAborted
from lmprog_runtime.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "QueueFull",
    "RequestAborted",
    "Runtime",
    "RuntimeConfig",
    "SamplingParams",
    "default_model_path",
    "local_model_dir",
    "named_models",
    "notebook_model",
    "resolve_model_path",
]
