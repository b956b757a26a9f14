"""The output file while things go wrong: a failed write, a row that never ends, a stop.

- A write cut short by a full disk, then retried when the map stopped, left half a line
  followed by the whole chunk again: a file `resume=True` refused, with rows twice.
- The once-a-second write ran only when a row finished: with one long row, finished rows
  stayed unwritten for minutes (a kill lost them all).
- A stopped map waited for rows still busy in Python code before writing the finished
  ones, so a second Ctrl-C while it waited lost every one of them.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter

import pytest
from map_programs import GREEDY, make_rows, qa, read_jsonl

import lmprog as lp
import lmprog.datasets.runner as runner
import lmprog.datasets.sinks as sinks

WAIT_S = 60


def test_a_failed_write_leaves_whole_lines_and_the_run_resumes(engine, tmp_path, monkeypatch):
    rows = make_rows(40)
    full = {r["id"]: r for r in qa.map(rows, id_column="id", backend=engine, **GREEDY)}
    out = tmp_path / "out.jsonl"
    write, calls = os.write, []

    def disk_fills_once(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == str(out):
            calls.append(len(data))
            if len(calls) == 2:  # the second write: half of it, then the disk is full
                write(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(sinks.os, "write", disk_fills_once)
    monkeypatch.setattr(runner, "FLUSH_ROWS", 8)  # (writes mid-run)
    with pytest.raises(OSError, match="No space left"):  # (one row at a time: rows finishing
        # together, on a loaded machine, went out in one write, which the disk let through)
        qa.map(rows, output=out, id_column="id", num_threads=1, backend=engine, **GREEDY).run()
    assert len(calls) >= 3  # (the half was cut off again, and the chunk written whole)
    written = read_jsonl(out)  # every line whole
    assert written and max(Counter(r["id"] for r in written).values()) == 1
    summary = qa.map(rows, output=out, id_column="id", resume=True, backend=engine, **GREEDY)
    assert summary.run().num_skipped == len(written)
    final = read_jsonl(out)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in rows)
    assert all(r["answer"] == full[r["id"]]["answer"] for r in final)


RELEASE = threading.Event()  # row q1's program waits for it
BODIES_DONE: list[str] = []  # the rows whose program body has returned


@lp.function
def one_is_slow(s, q):
    if q == "q1":
        RELEASE.wait(WAIT_S)  # (a tool call with no timeout, say)
    s += q + lp.gen("answer", max_tokens=2, temperature=0)
    BODIES_DONE.append(s["answer"])  # (reading it waits for the gen)


@pytest.fixture
def release():
    RELEASE.clear()
    BODIES_DONE.clear()
    yield RELEASE
    RELEASE.set()


def lines_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_finished_rows_are_written_while_a_long_row_runs(engine, tmp_path, release):
    rows = [{"q": f"q{i}"} for i in range(10)]
    out = tmp_path / "out.jsonl"
    run = one_is_slow.map(rows, output=out, ordered=False, backend=engine)
    thread = threading.Thread(target=run.run)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while lines_in(out) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the file
        assert lines_in(out) == 9 and not release.is_set()
    finally:
        release.set()
        thread.join(WAIT_S)
    assert sorted(r["q"] for r in read_jsonl(out)) == [f"q{i}" for i in range(10)]


def test_a_stopped_run_writes_its_finished_rows_before_waiting_for_a_busy_one(
    engine, tmp_path, release
):
    """In input order rows 2-9 wait for row 1, whose program is busy in Python code: a
    stop writes them at once, then waits for row 1 (cancelled, or done)."""
    rows = [{"q": f"q{i}"} for i in range(10)]
    out = tmp_path / "out.jsonl"
    run = iter(one_is_slow.map(rows, output=out, backend=engine))
    assert next(run)["q"] == "q0"
    deadline = time.monotonic() + WAIT_S
    while len(BODIES_DONE) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop = threading.Thread(target=run.close)  # (it waits for row 1's body)
    stop.start()
    try:
        while lines_in(out) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the file
        assert lines_in(out) == 9 and stop.is_alive() and not release.is_set()
    finally:
        release.set()
        stop.join(WAIT_S)
    written = [r["q"] for r in read_jsonl(out)]
    assert {f"q{i}" for i in range(10) if i != 1} <= set(written) and "q1" not in written[:9]
