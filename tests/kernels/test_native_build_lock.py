"""A process killed while torch built or loaded the native kernels left torch's lock file in
the build directory, and every later process waited on it forever at its first engine (in
CI: each notebook's kernel, 600 s a cell). Now a later process loads them."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from lmprog_runtime.native import OWN_LOCK, TORCH_LOCK, build_directory, load_native

LOAD = (
    "import logging; logging.basicConfig()\n"
    "from lmprog_runtime.native import load_native\n"
    "load_native(); print('loaded', flush=True)\n"
)


@pytest.fixture
def built():
    """The build directory, the kernels built there (skips where they cannot be built)."""
    try:
        load_native()
    except RuntimeError as error:
        pytest.skip(str(error))
    return build_directory()


def load_in_a_new_process() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)


def test_a_lock_file_left_by_a_killed_process_is_removed(built):
    stale = built / TORCH_LOCK
    stale.touch()  # (as a process SIGKILLed inside torch's build leaves it)
    try:
        proc = load_in_a_new_process()
        left = stale.exists()
    finally:
        stale.unlink(missing_ok=True)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
    assert not left and "left by a process killed" in proc.stderr


def test_a_process_killed_inside_the_build_holds_no_one_up(built):
    """It dies holding both locks: the kernel lets go of lmprog's, and the next process
    removes torch's."""
    hold = (
        "import time\n"
        "from pathlib import Path\n"
        "from lmprog_runtime.native import TORCH_LOCK, build_lock\n"
        f"directory = Path({str(built)!r})\n"
        "with build_lock(directory):\n"
        "    (directory / TORCH_LOCK).touch()\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        proc = load_in_a_new_process()
    finally:
        holder.kill()
        (built / TORCH_LOCK).unlink(missing_ok=True)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
    assert (built / OWN_LOCK).exists()  # (the file stays; only its lock went)


def test_where_flock_is_refused_torchs_lock_alone_guards_the_build(tmp_path, monkeypatch):
    """A filesystem without locks (ENOLCK) failed the build, and the engine fell back to
    the torch backend."""
    import errno
    import fcntl

    from lmprog_runtime.native import build_lock

    def refused(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    (tmp_path / TORCH_LOCK).touch()
    entered = False
    with build_lock(tmp_path):
        entered = True
    assert entered and (tmp_path / TORCH_LOCK).exists()  # (without the lock, not ours to remove)


def test_a_killed_builds_orphaned_compilers_are_waited_for(tmp_path):
    """The ninja and compilers of a build whose process was SIGKILLed run on, orphaned,
    writing its objects: the next build waited for nothing and ran beside them."""
    import time

    from lmprog_runtime.native import build_lock

    (tmp_path / TORCH_LOCK).touch()
    compiler = subprocess.Popen(["sleep", "1.5"], cwd=tmp_path)  # (its cwd: the build's)
    try:
        start = time.monotonic()
        with build_lock(tmp_path):
            waited = time.monotonic() - start
            left = sorted(p.name for p in tmp_path.iterdir())
    finally:
        compiler.kill()
    assert compiler.poll() is not None and waited >= 1.0
    assert left == [OWN_LOCK]  # (torch's lock gone)
