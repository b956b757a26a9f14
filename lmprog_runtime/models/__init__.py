"""Model forward passes over the paged KV pool, their loaders (HF directories and GGUF files),
the built-in checkpoints and the named-model registry."""

from lmprog_runtime.models.default_model import default_model_path
from lmprog_runtime.models.loader import load_model
from lmprog_runtime.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from lmprog_runtime.models.registry import (
    local_model_dir,
    named_models,
    notebook_model,
    resolve_model_path,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "default_model_path",
    "load_model",
    "local_model_dir",
    "named_models",
    "notebook_model",
    "resolve_model_path",
]
