"""A script that ends while one of its programs compiles a pattern exits at once. The
compile threads were a ThreadPoolExecutor's, which the interpreter's exit joins before the
engine's at-exit shutdown can stop them: the exit waited for the compile, up to
`grammar_compile_timeout_s` (a script with a daemon thread's program: over 100 s)."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from lmprog_runtime.constrained.daemon_pool import DaemonPool

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
SCRIPT = f"""
import sys, threading, time
import psutil
sys.path.insert(0, {str(DATASETS)!r})
import lmprog as lp
from map_programs import explodes  # (its regex compiles for minutes over the tiny vocabulary)

engine = lp.Engine("tiny", grammar_compile_timeout_s=600)
run = lambda: explodes.run(question="Code?", backend=engine, temperature=0)
threading.Thread(target=run, daemon=True).start()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    children = [c for c in psutil.Process().children() if "index_child" in " ".join(c.cmdline())]
    if children:
        break
    time.sleep(0.05)
print(" ".join(str(c.pid) for c in children), flush=True)
"""


def test_a_script_ending_during_a_compile_exits_at_once():
    psutil = pytest.importorskip("psutil")
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        left = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        seconds = time.monotonic() - left
    finally:
        proc.kill()
    assert pids, f"the compile never started: {stderr[-2000:]}"
    assert proc.returncode == 0, stderr[-2000:]
    assert seconds < 30, f"the exit took {seconds:.0f} s"  # (the compile's timeout is 600 s)
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, "the compile's process outlived the script"
        time.sleep(0.05)


def test_the_pool_runs_its_work_on_daemon_threads_up_to_its_size():
    pool = DaemonPool(max_workers=2, name="test-pool")
    release = threading.Event()
    names = []

    def work(value):
        names.append(threading.current_thread())
        release.wait(10)
        return value * 2

    futures = [pool.submit(work, i) for i in range(5)]
    time.sleep(0.2)
    assert len(names) == 2 and all(t.daemon for t in names)  # two run, three wait
    release.set()
    assert [f.result(timeout=10) for f in futures] == [0, 2, 4, 6, 8]
    assert len({t.name for t in names}) == 2  # (the idle threads took the rest)
    assert pool.submit(work, 5).result(timeout=10) == 10
    assert len({t.name for t in names}) == 2  # an idle thread is reused, none started
    pool.shutdown()
    for thread in names:
        thread.join(10)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        pool.submit(work, 0)


def test_shutdown_cancels_queued_work_and_lets_running_work_finish():
    pool = DaemonPool(max_workers=1, name="test-pool")
    release = threading.Event()
    running = pool.submit(release.wait, 10)
    queued = pool.submit(lambda: "never")
    errors = pool.submit(lambda: 1 / 0)
    pool.shutdown(cancel_futures=True)
    assert queued.cancelled() and errors.cancelled() and not running.done()
    release.set()
    assert running.result(timeout=10) is True


def test_an_exception_reaches_the_future():
    pool = DaemonPool(max_workers=1, name="test-pool")
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)
    pool.shutdown()


def test_a_dropped_pool_ends_its_threads_and_holds_nothing_of_its_work():
    class Work:  # (a compile's cache: its bound method is what a thread ran)
        def run(self) -> int:
            return 1

    pool = DaemonPool(max_workers=2, name="test-dropped-pool")
    work = Work()
    assert [f.result(timeout=10) for f in [pool.submit(work.run) for _ in range(4)]] == [1] * 4
    threads = [t for t in threading.enumerate() if t.name.startswith("test-dropped-pool")]
    work_ref = weakref.ref(work)
    del work
    gc.collect()
    assert threads and work_ref() is None  # (idle threads hold no work)
    del pool
    gc.collect()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_second_shutdown_cancelling_the_queue_leaves_the_threads_their_ends():
    """A compile timed out (its pool shut down), then the engine shut down (the same pool,
    its queue cancelled): the cancel took the threads' ends off the queue too, and the
    thread of the timed-out compile waited for work forever."""
    pool = DaemonPool(max_workers=1, name="test-twice-shut-pool")
    release = threading.Event()
    running = pool.submit(release.wait, 10)
    queued = pool.submit(lambda: "never")
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("test-twice-shut-pool")]
    pool.shutdown()
    pool.shutdown(cancel_futures=True)
    release.set()
    assert running.result(timeout=10) is True and queued.cancelled()
    thread.join(10)
    assert not thread.is_alive()
