"""The native CPU kernels of `csrc/`, compiled on first use as a torch C++ extension.

Built with OpenMP and `-march=native` into `$LMPROG_CACHE_DIR/native/<source hash>/`, so a
rebuild happens only when the sources change (or on another machine). Nothing is compiled
unless the `native` attention backend is asked for.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from types import ModuleType

from lmprog_runtime.env import cache_dir

_SOURCES = (
    "amx_linear.cpp",
    "decode_attention.cpp",
    "decode_stack.cpp",
    "extend_attention.cpp",
    "fused_ops.cpp",
    "quant_linear.cpp",
)
# Included by the sources: part of the hash, not compiled alone.
_HEADERS = ("amx.h", "cpu_vec.h", "native_ops.h")
_lock = threading.Lock()
_module: ModuleType | None = None


def csrc_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "csrc"


def load_native() -> ModuleType:
    """Compile (once) and import the extension; raises RuntimeError if it cannot be built."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        sources = [csrc_dir() / name for name in _SOURCES]
        hashed = sources + [csrc_dir() / name for name in _HEADERS]
        missing = [str(s) for s in hashed if not s.is_file()]
        if missing:
            raise RuntimeError(f"native kernels need the csrc/ sources; missing: {missing}")
        digest = hashlib.sha256(b"".join(s.read_bytes() for s in hashed)).hexdigest()[:16]
        build_dir = cache_dir() / "native" / digest
        build_dir.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        try:
            _module = cpp_extension.load(
                name=f"lmprog_native_{digest}",
                sources=[str(s) for s in sources],
                build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as error:  # compiler missing, ninja missing, build error
            raise RuntimeError(f"could not build the native CPU kernels: {error}") from error
        return _module
