"""The one place environment variables are read. All of them carry the `LMPROG_` prefix."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where built-in default models are built: `$LMPROG_CACHE_DIR`, else ~/.cache/lmprog."""
    value = os.environ.get("LMPROG_CACHE_DIR")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "lmprog"


def notebook_model_override() -> str | None:
    """`$LMPROG_NOTEBOOK_MODEL`: the model the notebooks run instead of their default (the
    tests set `tiny`)."""
    return os.environ.get("LMPROG_NOTEBOOK_MODEL") or None
