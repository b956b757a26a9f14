"""lmprog: write structured LLM programs in Python and run them on an in-process runtime.

`lmprog.Engine` is the runtime's engine; it is imported lazily so `import lmprog` stays
light (the frontend itself never touches tensors).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "default_model_path"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "default_model_path"):
        import lmprog_runtime

        return getattr(lmprog_runtime, name)
    raise AttributeError(f"module 'lmprog' has no attribute {name!r}")
