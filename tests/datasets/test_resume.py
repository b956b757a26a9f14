"""Resumable output: a run killed at any point and started again with `resume=True` ends
with every row exactly once, each equal to an uninterrupted run's.

The kill test runs the CLI in a subprocess and SIGKILLs it at random points (drawn with a
fixed seed); the others stop a run in-process (closing its iterator) or cut the file by hand."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from map_programs import GREEDY, make_rows, qa, read_jsonl, short, write_jsonl

import lmprog as lp
from lmprog.interpreter import INTERPRETER

HERE = Path(__file__).resolve().parent
COMPARED = ("id", "question", "answer", "verdict", "ret_value", "error")


def same(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in COMPARED)


def test_resume_drops_a_partial_last_line_and_skips_written_rows(engine, tmp_path):
    rows = make_rows(120)
    full = list(qa.map(rows, id_column="id", backend=engine, **GREEDY))
    out = tmp_path / "out.jsonl"
    lines = full[:50]
    write_jsonl(out, lines)
    with out.open("rb+") as f:  # a write cut by a kill: half of line 51 and no newline
        f.seek(0, os.SEEK_END)
        f.write(write_jsonl(tmp_path / "one.jsonl", [full[50]]).read_bytes()[:40])
    summary = qa.map(rows, output=out, id_column="id", resume=True, backend=engine, **GREEDY).run()
    assert (summary.num_rows, summary.num_skipped) == (70, 50)
    written = read_jsonl(out)
    assert Counter(r["id"] for r in written) == Counter(r["id"] for r in rows)
    by_id = {r["id"]: r for r in full}
    assert all(same(r, by_id[r["id"]]) for r in written)
    assert written[:50] == lines


def test_a_stopped_run_writes_finished_rows_only_and_leaves_no_thread(engine, tmp_path):
    rows = make_rows(300)
    full = {r["row_index"]: r for r in qa.map(rows, backend=engine, **GREEDY)}
    out = tmp_path / "out.parquet"
    baseline = {t.ident for t in threading.enumerate()}
    run = qa.map(rows, output=out, window=64, backend=engine, **GREEDY)
    for n, _ in enumerate(run, 1):
        if n == 100:
            break  # closes the iterator: the programs still running are cancelled
    assert not out.exists()  # the Parquet file is built once every row is done
    journal = read_jsonl(tmp_path / "out.parquet.journal.jsonl")
    assert len(journal) >= 100 and all(r["error"] is None for r in journal)
    assert all(same(r, full[r["row_index"]]) for r in journal)
    deadline = time.monotonic() + 10
    while {t.ident for t in threading.enumerate()} - baseline and time.monotonic() < deadline:
        time.sleep(0.05)  # the interpreter thread exits on its own once idle
    assert not {t.ident for t in threading.enumerate()} - baseline

    summary = qa.map(rows, output=out, resume=True, backend=engine, **GREEDY).run()
    assert summary.num_skipped == len(journal)
    assert not (tmp_path / "out.parquet.journal.jsonl").exists()
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pylist()
    assert sorted(r["row_index"] for r in table) == list(range(300))
    assert all(same(r, full[r["row_index"]]) for r in table)


def test_resuming_a_finished_parquet_file_adds_new_rows(engine, tmp_path):
    import pyarrow.parquet as pq

    rows = make_rows(80)
    out = tmp_path / "out.parquet"
    qa.map(rows[:50], output=out, id_column="id", backend=engine, **GREEDY).run()
    summary = qa.map(rows, output=out, id_column="id", resume=True, backend=engine, **GREEDY).run()
    assert (summary.num_rows, summary.num_skipped) == (30, 50)
    table = pq.read_table(out).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(r["id"] for r in rows)
    full = {r["id"]: r for r in qa.map(rows, id_column="id", backend=engine, **GREEDY)}
    assert all(same(r, full[r["id"]]) for r in table)


def test_resume_counts_the_input_rows_it_skips_not_the_rows_the_file_holds(engine, tmp_path):
    """The output holds rows 0-49; the input is rows 40-79: ten skipped, thirty run (the
    summary said 50 skipped, the rows the file held)."""
    rows = make_rows(80)
    out = tmp_path / "out.jsonl"
    qa.map(rows[:50], output=out, id_column="id", backend=engine, **GREEDY).run()
    run = qa.map(rows[40:], output=out, id_column="id", resume=True, progress=True, backend=engine)
    summary = run.run()
    assert (summary.num_rows, summary.num_skipped) == (30, 10)
    assert sorted(r["id"] for r in read_jsonl(out)) == sorted(r["id"] for r in rows)


def test_resuming_a_parquet_file_whose_ids_mix_ints_and_strings_runs_each_row_once(
    engine, tmp_path
):
    """Ids 1 and "row 0" make a JSON text column (`1`, `"row 0"`), which a resumed run reads
    back as they were: 1 and "1" stay two rows (once both "1": rows 1 and 3 ran twice)."""
    import pyarrow.parquet as pq

    rows = [{**row, "id": i if i % 2 else f"row {i}"} for i, row in enumerate(make_rows(6))]
    rows.append({**rows[1], "id": "1"})  # (the string "1": another row than 1)
    out = tmp_path / "out.parquet"
    qa.map(rows[:4], output=out, id_column="id", backend=engine, **GREEDY).run()
    summary = qa.map(rows, output=out, id_column="id", resume=True, backend=engine, **GREEDY).run()
    assert (summary.num_rows, summary.num_skipped) == (3, 4)
    ids = [r["id"] for r in pq.read_table(out).to_pylist()]
    assert sorted(ids) == sorted(json.dumps(row["id"]) for row in rows)


def test_resuming_with_numpy_integer_ids_runs_each_row_once(engine, tmp_path):
    """An id np.int64(0) is written as 0; read back, it is the same row (once "0", a
    string, so every row ran again)."""
    np = pytest.importorskip("numpy")
    rows = [{**row, "id": np.int64(i)} for i, row in enumerate(make_rows(4))]
    out = tmp_path / "out.jsonl"
    qa.map(rows[:2], output=out, id_column="id", backend=engine, **GREEDY).run()
    summary = qa.map(rows, output=out, id_column="id", resume=True, backend=engine, **GREEDY).run()
    assert (summary.num_rows, summary.num_skipped) == (2, 2)
    assert sorted(r["id"] for r in read_jsonl(out)) == [0, 1, 2, 3]


def test_duplicate_ids_are_refused(engine, tmp_path):
    rows = make_rows(10) + [make_rows(10)[3]]
    with pytest.raises(ValueError, match="id_column 'id'.* appears twice"):
        qa.map(rows, output=tmp_path / "o.jsonl", id_column="id", backend=engine).run()
    assert not (tmp_path / "o.jsonl").exists()  # no row ran: no file is left
    out = tmp_path / "o.jsonl"
    with pytest.raises(ValueError, match="id_column 'id'.* appears twice"):  # (window 3)
        qa.map(rows, output=out, id_column="id", window=4, backend=engine).run()
    assert 0 < len(read_jsonl(out)) <= 10  # what finished before stays


def cli_run(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmprog", "run", f"{HERE / 'map_programs.py'}:short", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize("num_rows, num_kills", [(2000, 3)])
def test_sigkill_at_random_points_then_resume(engine, tmp_path, num_rows, num_kills):
    rng = random.Random(15)  # fixed points, so a run is reproducible
    rows = [{"id": f"r{i}", "question": f"Question {i}: where is it?"} for i in range(num_rows)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = ["--input", str(source), "--output", str(out), "--id-column", "id", "--resume"]
    args += ["--set", "temperature=0", "--quiet", "--window", "256"]
    points = sorted(rng.sample(range(1, num_rows - 100), num_kills))
    for point in points:
        # (past the rows already there: a point an earlier run's last write passed would
        # kill the new run as it starts, in the middle of its imports and its first engine)
        until = max(point, count_lines(out) + 1)
        proc = cli_run(args)
        while count_lines(out) < until:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.01)  # polling another process's output file
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
    proc = cli_run(args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]

    written = read_jsonl(out)
    counts = Counter(r["id"] for r in written)
    assert set(counts) == {r["id"] for r in rows} and set(counts.values()) == {1}
    uninterrupted = short.map(rows, id_column="id", backend=engine, **GREEDY)
    reference = {r["id"]: r for r in uninterrupted}
    assert all(r == reference[r["id"]] and r["error"] is None for r in written)


@pytest.mark.parametrize("id_column", [None, "id"])
def test_a_stopped_ordered_run_writes_the_rows_waiting_for_an_earlier_one(
    engine, tmp_path, id_column
):
    """Row 1 runs long; rows 2-9 finish before it, and wait for it (input order). Breaking
    out of the loop writes them too, not only row 0; a resumed run (by id, or by row
    position) runs the rest, and the file ends with each row once."""
    release = threading.Event()
    bodies_done = []

    @lp.function
    def second_is_slow(s, q):
        if q == "q1":
            release.wait(timeout=60)
        s += q + lp.gen("answer", max_tokens=2)
        bodies_done.append(s["answer"])  # (reading it waits for the gen)

    rows = [{"id": f"r{i}", "q": f"q{i}"} for i in range(10)]
    key = id_column or "row_index"
    out = tmp_path / "out.jsonl"
    run = iter(second_is_slow.map(rows, output=out, id_column=id_column, backend=engine, **GREEDY))
    assert next(run)["q"] == "q0"
    deadline = time.monotonic() + 60
    # (the nine programs have ended: only row 1's stream is live; a body that has returned
    # may not have ended its program yet, and one the close cancels then is not written)
    while (len(bodies_done) < 9 or INTERPRETER._num_live > 1) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the other rows' progress
    assert len(bodies_done) == 9
    release.set()  # (row 1 goes on, and is cancelled or finishes: either is right)
    run.close()
    written = read_jsonl(out)
    keys = [r[key] for r in written]
    everyone_but_1 = {rows[i]["id"] if id_column else i for i in range(10) if i != 1}
    assert everyone_but_1 <= set(keys) and len(keys) == len(set(keys))
    assert all(r["error"] is None for r in written)

    resumed = second_is_slow.map(
        rows, output=out, id_column=id_column, resume=True, backend=engine, **GREEDY
    )
    summary = resumed.run()
    assert (summary.num_rows, summary.num_skipped) == (10 - len(written), len(written))
    final = read_jsonl(out)
    assert sorted(r[key] for r in final) == sorted(
        r["id"] if id_column else i for i, r in enumerate(rows)
    )
    reference = {
        r["q"]: r for r in second_is_slow.map(rows, id_column="id", backend=engine, **GREEDY)
    }
    assert all(r["answer"] == reference[r["q"]]["answer"] for r in final)
