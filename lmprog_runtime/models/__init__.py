"""Model forward passes over the paged KV pool, their loader, and the built-in checkpoints."""

from lmprog_runtime.models.default_model import default_model_path
from lmprog_runtime.models.loader import load_model
from lmprog_runtime.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "default_model_path", "load_model"]
