"""Small defects of dataset runs, each against a reference computed here: a map that stops
at once leaves no output file it created (in-process and through the CLI, JSONL and
Parquet, a resumed file kept as it was), bytes that are not UTF-8 are said with the file
and line, and the progress total of a JSONL file counts the rows its reader yields."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from map_programs import read_jsonl, write_jsonl

import lmprog as lp
from lmprog.datasets.sinks import journal_path
from lmprog.datasets.sources import open_source

PROGRAMS = Path(__file__).resolve().parent / "map_programs.py"
GOOD = [{"id": i, "question": f"Where is parcel {i}?"} for i in range(6)]


@lp.function
def echo(s, question):
    """No request: the rows run at once, and their results are known without a model."""
    s += question
    return question.upper()


def expected(rows: list[dict]) -> list[dict]:
    """The output rows of `echo`, written out by hand."""
    return [{**r, "ret_value": r["question"].upper(), "error": None} for r in rows]


def bad_inputs(tmp_path: Path) -> dict[str, object]:
    """Inputs that stop a map with `id_column="id"` before any row is written."""
    non_utf8 = tmp_path / "latin1.jsonl"
    non_utf8.write_bytes(b'{"id": 0, "question": "caf\xe9"}\n')
    return {
        "no id column": [{"question": "Where?"}],
        "duplicate id": [GOOD[0], GOOD[1], GOOD[0]],
        "reserved column": [{**GOOD[0], "error": "x"}],
        "not UTF-8": non_utf8,
    }


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("case", ["no id column", "duplicate id", "reserved column", "not UTF-8"])
def test_a_map_that_stops_at_once_leaves_no_output(engine, tmp_path, suffix, case):
    out = tmp_path / f"out{suffix}"
    with pytest.raises(ValueError):
        echo.map(bad_inputs(tmp_path)[case], output=out, id_column="id", backend=engine).run()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.jsonl"]

    # The corrected command runs without `resume`, and writes what `echo` gives.
    summary = echo.map(GOOD, output=out, id_column="id", backend=engine).run()
    assert summary.num_rows == len(GOOD)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        assert not journal_path(out).exists()
        assert pq.read_table(out).to_pylist() == expected(GOOD)
    else:
        assert read_jsonl(out) == expected(GOOD)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_resumed_output_stays_when_the_run_stops_at_once(engine, tmp_path, suffix):
    out = tmp_path / f"out{suffix}"
    echo.map(GOOD[:3], output=out, id_column="id", backend=engine).run()
    before = out.read_bytes()
    with pytest.raises(ValueError, match="appears twice"):
        echo.map(GOOD + [GOOD[4]], output=out, id_column="id", resume=True, backend=engine).run()
    assert out.read_bytes() == before

    summary = echo.map(GOOD, output=out, id_column="id", resume=True, backend=engine).run()
    assert (summary.num_rows, summary.num_skipped) == (3, 3)
    if suffix == ".jsonl":
        assert sorted(read_jsonl(out), key=lambda r: r["id"]) == expected(GOOD)


def test_an_empty_input_still_writes_its_output(engine, tmp_path):
    out = tmp_path / "out.jsonl"
    assert echo.map([], output=out, backend=engine).run().num_rows == 0
    assert out.read_bytes() == b""


def test_the_cli_leaves_no_output_when_the_ids_are_missing(engine, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"question": "Where?"}])
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "lmprog", "run", f"{PROGRAMS}:short", "--input", str(source)]
    command += ["--output", str(out), "--quiet", "--set", "temperature=0"]
    proc = subprocess.run(
        command + ["--id-column", "id"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "no id_column 'id'" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()

    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300
    )  # the corrected command
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["question"] for r in read_jsonl(out)] == ["Where?"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
@pytest.mark.parametrize("bad_line", [1, 2, 5])
def test_bytes_that_are_not_utf8_are_said_with_file_and_line(tmp_path, suffix, bad_line):
    if suffix == ".jsonl":
        lines = [json.dumps({"q": f"row {i}"}).encode() for i in range(1, 7)]
    else:
        lines = [b"q"] + [f"row {i}".encode() for i in range(1, 6)]
    lines[bad_line - 1] = lines[bad_line - 1].replace(b"row", b"r\xe9w")
    if suffix == ".csv" and bad_line == 1:
        lines[0] = b"\xe9q"
    path = tmp_path / f"in{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError) as info:
        list(open_source(path))
    assert str(info.value).startswith(f"{path}:{bad_line}: ")
    assert "0xe9" in str(info.value)


def test_the_jsonl_total_counts_the_rows_the_reader_yields(tmp_path):
    # Lines the reader strips to nothing, among them one holding only the byte order mark.
    blank_lines = ["\ufeff", "\u00a0", "\u2003 \t", "\u3000", " ", ""]
    rows = [json.dumps({"q": i}) for i in range(4)]
    text = "\n".join([*blank_lines, rows[0], rows[1], "\u00a0\u00a0", rows[2] + "\r", rows[3]])
    path = tmp_path / "in.jsonl"
    path.write_bytes(text.encode() + b"\n")
    source = open_source(path)
    assert source.num_rows == len(list(source)) == len(rows)


def test_a_csv_and_a_txt_input_have_a_progress_total(tmp_path):
    """A CSV input's bar (and the CLI's `.txt` one's) had no total: "2row" with no
    percentage. The total counts the rows the reader yields: blank lines are none, a
    quoted cell may span lines."""
    path = tmp_path / "in.csv"
    path.write_text('id,question\n0,"two\nlines"\n\n1,plain\n2,"a ""quoted"" one"\n')
    source = open_source(path)
    assert source.num_rows == len(list(source)) == 3
    txt = write_lines(tmp_path / "in.txt", ["First?", "", "  ", "Second?", "Third?"])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "lmprog", "generate", "--input", str(txt), "--output", str(out)]
        + ["--set", "max_new_tokens=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3/3" in proc.stderr and "100%" in proc.stderr
    assert len(read_jsonl(out)) == 3


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@lp.function
def slow_echo(s, question):
    """Each row outlasts tqdm's refresh interval (0.1 s): every update finds the bar due one."""
    time.sleep(0.15)
    s += question


def test_the_progress_bar_prints_its_final_line_once(engine, capsys):
    capsys.readouterr()
    rows = list(slow_echo.map(GOOD[:3], num_threads=1, progress=True, backend=engine))
    err = capsys.readouterr().err
    # Each display of the bar starts with "\r"; the last one, and only it, shows 100%.
    displays = [d for d in err.split("\r") if d.strip()]
    assert [d for d in displays if "100%" in d] == [displays[-1]], displays
    assert "3/3" in displays[-1]
    assert [r["question"] for r in rows] == [r["question"] for r in GOOD[:3]]
