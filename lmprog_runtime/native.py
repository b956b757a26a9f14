"""The native CPU kernels of `csrc/`, compiled on first use as a torch C++ extension.

Built with OpenMP and `-march=native` into `$LMPROG_CACHE_DIR/native/<key>/`, the key a hash
of the sources, the torch and Python versions and this CPU's instruction sets: a cache shared
between machines (a network home, a container image built elsewhere) never hands one CPU a
build that uses instructions it lacks (AMX, AVX512-BF16), nor torch a build against another
torch. Nothing is compiled unless the `native` attention backend is asked for.

torch's own lock on a build directory is a file its holder removes when done: a process
killed while it held it (SIGKILL, the OOM killer, a lost container) left it, and every
later process waited on it forever at its first engine. So every lmprog process takes a
lock of the kernel's (`flock`, let go when its holder dies) around torch's, and whoever
holds it removes a torch lock file it finds: no live lmprog process can own that one. A
killed build's ninja and compilers may still run, orphaned: they are waited for first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
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
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's lock file in the build directory
OWN_LOCK = "lmprog.flock"
ORPHANS_WAIT_S = 300.0  # how long a killed build's compilers may still run
logger = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None


def csrc_dir() -> Path:
    """The C++ sources: package data, so an installed wheel builds them too (they were
    beside the package, in no wheel: installed copies ran the torch backend)."""
    return Path(__file__).resolve().parent / "csrc"


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


def build_directory() -> Path:
    """Where this CPU, torch and these sources build: `$LMPROG_CACHE_DIR/native/<key>/`."""
    sources = [csrc_dir() / name for name in _SOURCES + _HEADERS]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise RuntimeError(f"native kernels need the csrc/ sources; missing: {missing}")
    return cache_dir() / "native" / build_key(sources)


def load_native() -> ModuleType:
    """Compile (once) and import the extension; raises RuntimeError if it cannot be built."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        try:
            with build_lock(build_dir), _ninja_on_path():
                _module = cpp_extension.load(
                    name=f"lmprog_native_{build_dir.name}",
                    sources=[str(csrc_dir() / name) for name in _SOURCES],
                    build_directory=str(build_dir),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
        except Exception as error:  # compiler missing, ninja missing, build error
            raise RuntimeError(f"could not build the native CPU kernels: {error}") from error
        return _module


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH; the `ninja` package puts it beside this interpreter,
    which is on PATH only where its environment is activated (`.venv/bin/python ...`
    found none). That directory is added for the build, where PATH has no ninja."""
    path = os.environ.get("PATH", "")
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is not None or not os.path.isfile(os.path.join(scripts, "ninja")):
        yield
        return
    os.environ["PATH"] = scripts + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Held across torch's build and load in `build_dir` (waits while another process
    builds there); removes the torch lock file a dead process left (see the module doc).
    Where there is no `flock` (not POSIX, a filesystem without locks), torch's alone."""
    with contextlib.ExitStack() as stack:
        if _flock(stack, build_dir / OWN_LOCK):
            stale = build_dir / TORCH_LOCK
            if stale.exists():
                logger.warning("removing %s, left by a process killed while it held it", stale)
                _wait_for_orphans(build_dir)
                stale.unlink(missing_ok=True)
        yield


def _wait_for_orphans(build_dir: Path) -> None:
    """A build whose process was killed: its ninja and compilers run on, orphaned, in the
    build directory. Wait for them (at most `ORPHANS_WAIT_S`), so that the next build does
    not run beside them; it then rebuilds whatever they did not finish (ninja rebuilds an
    output its log does not record)."""
    deadline = time.monotonic() + ORPHANS_WAIT_S
    while _has_processes_in(build_dir) and time.monotonic() < deadline:
        time.sleep(0.2)


def _has_processes_in(directory: Path) -> bool:
    """Whether another process's working directory is `directory` (Linux's /proc; none
    found elsewhere). /proc gives the resolved path: a relative or symlinked cache
    directory is resolved to match it."""
    directory = directory.resolve()
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if Path(os.readlink(entry / "cwd")) == directory:
                    return True
    return False


def _flock(stack: contextlib.ExitStack, path: Path) -> bool:
    """Take an exclusive `flock` on `path` until `stack` closes (or this process dies)."""
    try:
        import fcntl
    except ImportError:
        return False
    handle = stack.enter_context(open(path, "a"))  # noqa: SIM115 - closed by the stack
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError as error:  # (ENOLCK: a filesystem without locks)
        logger.info("no lock on %s (%s): torch's own lock only", path, error)
        return False
    return True
