"""`resume=True, retry_errors=True` (CLI `--resume --retry-errors`): the rows whose output
line holds an error run again, and the file still holds each row once. Before, a failed
row (a raised error, a timeout) counted as done and no resume could run it again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from map_programs import GREEDY, read_jsonl, write_jsonl

import lmprog as lp

PROGRAMS = Path(__file__).resolve().parent / "map_programs.py"
FAILING: set[str] = set()  # questions `flaky` raises on


@lp.function
def flaky(s, question):
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=3))
    if question in FAILING:
        raise RuntimeError(f"flaky on {question!r}")


def read_output(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).to_dict("records")
        for row in rows:  # (pandas reads a missing string as NaN)
            row["error"] = row["error"] if isinstance(row["error"], str) else None
        return rows
    return read_jsonl(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_failed_rows_run_again_and_appear_once(engine, tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    rows = [{"id": i, "question": f"Question {i}?"} for i in range(8)]
    out = tmp_path / f"out{suffix}"

    def run(**options):
        return flaky.map(rows, output=out, id_column="id", backend=engine, **GREEDY, **options)

    FAILING.update({"Question 2?", "Question 5?"})
    try:
        assert run().run().num_errors == 2
    finally:
        FAILING.clear()
    first = {r["id"]: r for r in read_output(out)}
    assert sorted(i for i, r in first.items() if r["error"]) == [2, 5]

    again = run(resume=True).run()  # (a plain resume: failed rows count as done)
    assert (again.num_rows, again.num_skipped, again.num_skipped_errors) == (0, 8, 2)

    retried = run(resume=True, retry_errors=True).run()
    assert (retried.num_rows, retried.num_errors, retried.num_skipped) == (2, 0, 6)
    assert retried.num_skipped_errors == 0 and run(resume=True).run().num_skipped_errors == 0
    written = read_output(out)
    assert sorted(r["id"] for r in written) == list(range(8))  # each row once
    reference = {r["id"]: r for r in flaky.map(rows, id_column="id", backend=engine, **GREEDY)}
    for row in written:
        assert row["error"] is None and row["answer"] == reference[row["id"]]["answer"]
        if row["id"] not in (2, 5):  # (the rows that had succeeded are kept as they were)
            assert row == first[row["id"]]


def test_retry_errors_is_checked(engine, tmp_path):
    rows = [{"id": 0, "question": "Q?"}]
    with pytest.raises(ValueError, match="retry_errors=True .* resume=True"):
        flaky.map(rows, output=tmp_path / "o.jsonl", id_column="id", retry_errors=True)
    with pytest.raises(TypeError, match="retry_errors must be a bool"):
        flaky.map(rows, output=tmp_path / "o.jsonl", resume=True, retry_errors="yes")
    assert not (tmp_path / "o.jsonl").exists()


def test_the_cli_retries_the_failed_rows(tmp_path):
    """A row whose program raises fails again when retried: the file keeps one line for it."""
    rows = [{"id": f"r{i}", "system": "Be brief.", "question": f"Where is {i}?"} for i in range(3)]
    rows[1]["question"] = "raise on this one"
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "lmprog", "run", f"{PROGRAMS}:qa", "--input", str(source)]
    command += ["--output", str(out), "--id-column", "id", "--quiet", "--set", "temperature=0"]

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(command + list(extra), capture_output=True, text=True, timeout=300)

    proc = cli("--retry-errors")  # (without --resume: said before the model loads)
    assert proc.returncode == 2 and "add --resume" in proc.stderr and not out.exists()
    proc = cli()  # (a row failed: status 1, with the hint to retry)
    assert proc.returncode == 1 and "--resume --retry-errors" in proc.stderr, proc.stderr
    first = read_jsonl(out)
    # A plain resume runs nothing, and the output still holds the failed row: status 1 (it
    # was 0, as if every row had succeeded).
    proc = cli("--resume")
    assert proc.returncode == 1 and "--resume --retry-errors" in proc.stderr, proc.stderr
    assert "0 rows (0 with errors, 3 already done, 1 of them with errors)" in proc.stderr
    assert read_jsonl(out) == first
    proc = cli("--resume", "--retry-errors")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "1 rows (1 with errors, 2 already done)" in proc.stderr
    written = read_jsonl(out)
    assert sorted(r["id"] for r in written) == ["r0", "r1", "r2"]
    assert [r for r in written if r["id"] != "r1"] == [r for r in first if r["id"] != "r1"]
    assert "RuntimeError" in next(r["error"] for r in written if r["id"] == "r1")


def test_the_rewrite_keeps_the_file_a_symlink_names_and_its_mode(engine, tmp_path):
    """It replaced a symlink by a file of its own (the target kept the error lines and got
    no retried row), and a 0600 file came back 0644."""
    rows = [{"id": i, "question": f"Question {i}?"} for i in range(3)]
    target = tmp_path / "real.jsonl"
    link = tmp_path / "out.jsonl"
    FAILING.add("Question 1?")
    try:
        flaky.map(rows, output=target, id_column="id", backend=engine, **GREEDY).run()
    finally:
        FAILING.clear()
    target.chmod(0o600)
    link.symlink_to(target)
    retried = flaky.map(
        rows, output=link, id_column="id", resume=True, retry_errors=True, backend=engine, **GREEDY
    ).run()
    assert retried.num_rows == 1 and link.is_symlink()
    assert (target.stat().st_mode & 0o777) == 0o600
    written = read_jsonl(target)
    assert sorted(r["id"] for r in written) == [0, 1, 2] and all(
        r["error"] is None for r in written
    )


def test_a_rewrite_that_fails_leaves_the_file_and_no_copy(tmp_path, monkeypatch):
    from lmprog.datasets import sinks

    out = write_jsonl(tmp_path / "out.jsonl", [{"id": 0, "error": "x"}, {"id": 1, "error": None}])
    before = out.read_bytes()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sinks.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        sinks.JsonlSink(out, "id", retry_errors=True)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "out.jsonl"
    ]
