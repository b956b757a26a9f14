"""The native CPU kernels of `csrc/`, compiled on first use as a torch C++ extension.

Built with OpenMP and `-march=native` into `$LMPROG_CACHE_DIR/native/<key>/`, the key a hash
of the sources, the torch and Python versions and this CPU's instruction sets: a cache shared
between machines (a network home, a container image built elsewhere) never hands one CPU a
build that uses instructions it lacks (AMX, AVX512-BF16), nor torch a build against another
torch. Nothing is compiled unless the `native` attention backend is asked for.
"""

from __future__ import annotations

import hashlib
import platform
import sys
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
    "module.cpp",
    "quant_linear.cpp",
    "w8a8_linear.cpp",
)
# Included by the sources: part of the hash, not compiled alone.
_HEADERS = ("amx.h", "cpu_vec.h", "decode_rows.h", "extend_tiles.h", "native_ops.h")
_lock = threading.Lock()
_module: ModuleType | None = None


def csrc_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "csrc"


def cpu_flags() -> bytes:
    """This CPU's instruction-set flags as the kernel reports them (empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor().encode()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return " ".join(sorted(line.partition(":")[2].split())).encode()
    return b""


def build_key(sources: list[Path]) -> str:
    """What a build depends on: its sources, the torch and Python it links and this CPU."""
    import torch

    parts = [s.read_bytes() for s in sources]
    parts += [torch.__version__.encode(), sys.version.encode(), platform.machine().encode()]
    parts.append(cpu_flags())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


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
        digest = build_key(hashed)
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
