"""The `lmprog` command end to end, as a subprocess (`python -m lmprog`, what the console
script runs): `run` against the same program's `map` in-process, `--resume`, `generate`
against `engine.generate`, `--help`, and bad invocations."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from map_programs import GREEDY, make_rows, qa, read_jsonl, write_jsonl

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "map_programs.py"


def lmprog(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "lmprog", *args], capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_help_describes_every_command():
    top = lmprog("--help").stdout
    assert "run" in top and "generate" in top
    run = lmprog("run", "--help").stdout
    for flag in ("--input", "--output", "--model", "--id-column", "--resume", "--set", "--engine"):
        assert flag in run
    assert "FILE.py:FUNCTION" in run and "error" in run
    generate = lmprog("generate", "--help").stdout
    assert "--prompt-column" in generate and "--chat" in generate and "completion" in generate


def test_run_then_resume(engine, tmp_path):
    import pyarrow.parquet as pq

    rows = make_rows(150)
    source = write_jsonl(tmp_path / "in.jsonl", rows[:100])
    out = tmp_path / "out.parquet"
    common = ["--input", str(source), "--output", str(out), "--id-column", "id", "--usage"]
    common += ["--set", "temperature=0", "--engine", "max_total_tokens=8192"]
    first = lmprog("run", f"{PROGRAMS}:qa", *common)
    assert "100 rows (0 with errors, 0 already done)" in first.stderr
    assert "100/100" in first.stderr and "tok/s" in first.stderr  # the progress bar

    again = lmprog("run", f"{PROGRAMS}:qa", *common, check=False)
    assert again.returncode == 2 and "already exists" in again.stderr

    write_jsonl(source, rows)  # 50 more rows
    resumed = lmprog("run", f"{PROGRAMS}:qa", *common, "--resume", "--quiet")
    assert "50 rows (0 with errors, 100 already done)" in resumed.stderr
    assert "tok/s" not in resumed.stderr

    table = pq.read_table(out).to_pylist()
    reference = {r["id"]: r for r in qa.map(rows, id_column="id", backend=engine, **GREEDY)}
    assert sorted(r["id"] for r in table) == sorted(reference)
    for row in table:
        assert {k: row[k] for k in reference[row["id"]]} == reference[row["id"]]
        assert row["prompt_tokens"] > row["cached_tokens"] >= 0


def test_set_fixes_a_program_argument(engine, tmp_path):
    rows = [{"question": f"Where is parcel {i}?"} for i in range(5)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    system = "You answer in French."
    lmprog(
        "run", f"{PROGRAMS}:qa", "--input", str(source), "--output", str(out), "--quiet",
        "--set", "temperature=0", "--set", f"system={system}",
    )  # fmt: skip
    expected = list(qa.bind(system=system).map(rows, backend=engine, **GREEDY))
    assert read_jsonl(out) == expected


@pytest.mark.parametrize("chat", [False, True])
def test_generate_completes_plain_prompts(engine, tmp_path, chat):
    prompts = [f"Once upon a time, prompt {i}" for i in range(12)]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    flags = ["--chat"] if chat else []
    lmprog(
        "generate", "--input", str(tmp_path / "p.txt"), "--output", str(out), "--quiet",
        "--set", "temperature=0", "--set", "max_new_tokens=6", *flags,
    )  # fmt: skip
    rows = read_jsonl(out)
    assert [r["prompt"] for r in rows] == prompts
    for row in rows:
        text = row["prompt"]
        if chat:
            messages = [{"role": "user", "content": text}]
            text = engine.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        expected = engine.generate(text, {"max_new_tokens": 6, "temperature": 0})["text"]
        assert row["completion"] == expected and row["error"] is None


@pytest.mark.parametrize("column", ["text", "user prompt"])
def test_generate_reads_a_prompt_column(engine, tmp_path, column):
    """Any column name: one that is no Python identifier (or a keyword) was refused."""
    rows = [{"key": i, column: f"The number {i} is"} for i in range(6)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    lmprog(
        "generate", "--input", str(source), "--output", str(out), "--prompt-column", column,
        "--id-column", "key", "--quiet", "--set", "temperature=0", "--set", "max_new_tokens=4",
    )  # fmt: skip
    written = read_jsonl(out)
    assert [row["key"] for row in written] == list(range(6))
    for row in written:
        expected = engine.generate(row[column], {"max_new_tokens": 4, "temperature": 0})
        assert row["completion"] == expected["text"] and row["error"] is None
        assert set(row) == {"key", column, "completion", "ret_value", "error"}


def test_a_prompt_column_the_table_lacks_exits_2(tmp_path):
    source = tmp_path / "in.csv"
    source.write_text("id,question\n1,Why?\n", encoding="utf-8")
    out = tmp_path / "o.jsonl"
    args = ["generate", "--input", str(source), "--output", str(out), "--quiet"]
    proc = lmprog(*args, "--prompt-column", "user prompt", check=False)
    assert proc.returncode == 2 and "'user prompt' is not a column" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("column", ["prompt", "user prompt"])
def test_a_prompt_column_no_jsonl_row_has_exits_1(tmp_path, column):
    """A JSONL file's columns are known row by row: each row fails (and is written with its
    error), and the status says so. It was 0, as if the rows had run."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "Hi"}, {"text": "Yo"}])
    out = tmp_path / "o.jsonl"
    args = ["generate", "--input", str(source), "--output", str(out), "--quiet"]
    proc = lmprog(*args, "--prompt-column", column, "--set", "max_new_tokens=2", check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "2 rows (2 with errors" in proc.stderr and "--retry-errors" in proc.stderr
    written = read_jsonl(out)
    assert [row["text"] for row in written] == ["Hi", "Yo"]
    assert all(repr(column) in row["error"] for row in written)


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", f"{PROGRAMS}:nothing"], "is not an @lp.function"),
        (["run", "no_such_file.py:qa"], "does not exist"),
        (["run", "qa"], "must be FILE.py:FUNCTION"),
        (["run", f"{PROGRAMS}:qa", "--set", "temperature"], "--set takes KEY=VALUE"),
        (["run", f"{PROGRAMS}:qa", "--engine", "no_such_option=1"], "no_such_option"),
    ],
)
def test_bad_invocations_exit_2_with_a_message(tmp_path, args, message):
    source = write_jsonl(tmp_path / "in.jsonl", make_rows(3))
    io = ["--input", str(source), "--output", str(tmp_path / "o.jsonl"), "--quiet"]
    proc = lmprog(*args, *io, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_takes_a_prompt_column_named_s(engine, tmp_path):
    """The program's state is `s` elsewhere: a column of that name once clashed with it."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"s": "The number 3 is"}])
    out = tmp_path / "out.jsonl"
    lmprog(
        "generate", "--input", str(source), "--output", str(out), "--prompt-column", "s",
        "--quiet", "--set", "temperature=0", "--set", "max_new_tokens=4",
    )  # fmt: skip
    expected = engine.generate("The number 3 is", {"max_new_tokens": 4, "temperature": 0})
    assert [row["completion"] for row in read_jsonl(out)] == [expected["text"]]


def test_an_output_under_a_file_or_in_a_missing_directory_exits_2(tmp_path):
    """Said before the model loads (a path under a file once gave a traceback, exit 1)."""
    source = write_jsonl(tmp_path / "in.jsonl", make_rows(3))
    for output, message in (
        (source / "o.jsonl", "is not a directory"),
        (tmp_path / "missing" / "o.jsonl", "does not exist"),
    ):
        io = ["--input", str(source), "--output", str(output), "--quiet"]
        proc = lmprog("run", f"{PROGRAMS}:qa", *io, check=False)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "case, message",
    [
        ("syntax error", "broken.py:3: "),
        ("temperature=abc", "--set: temperature must be a number"),
        ("max_new_tokens=-1", "--set: max_new_tokens must be >= 0"),
        ("no column", "has no column 'question'"),
        ("no input", "does not exist"),
        ("--threads=0", "must be a positive integer, got 0"),
        ("--window=-3", "must be a positive integer, got -3"),
    ],
)
def test_bad_input_is_said_before_the_model_loads(tmp_path, case, message):
    """A program file with a syntax error (once a traceback, exit 1), a bad sampling value
    (once every row's error, exit 0), a missing column or input file: exit 2 with a message,
    before the model (here a missing one) loads."""
    broken = tmp_path / "broken.py"
    broken.write_text("import lmprog as lp\n\ndef broken(s:\n", encoding="utf-8")
    source = tmp_path / "in.csv"
    source.write_text("id,system\n1,Hi\n", encoding="utf-8")
    out = tmp_path / "o.jsonl"
    args = {
        "syntax error": ["run", f"{broken}:broken", "--input", str(source)],
        "temperature=abc": ["run", f"{PROGRAMS}:qa", "--input", str(source), "--set", case],
        "max_new_tokens=-1": ["run", f"{PROGRAMS}:qa", "--input", str(source), "--set", case],
        "no column": ["run", f"{PROGRAMS}:qa", "--input", str(source)],
        "no input": ["run", f"{PROGRAMS}:qa", "--input", str(tmp_path / "missing.jsonl")],
        "--threads=0": ["run", f"{PROGRAMS}:qa", "--input", str(source), case],
        "--window=-3": ["run", f"{PROGRAMS}:qa", "--input", str(source), case],
    }[case]
    io = ["--output", str(out), "--quiet", "--model", str(tmp_path / "no_such_model")]
    proc = lmprog(*args, *io, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("side", ["output", "input"])
def test_parquet_without_pyarrow_is_said_before_the_model_loads(tmp_path, side):
    """Without pyarrow (lmprog's `data` extra), a Parquet output failed after every row had
    run (exit 2, the rows left in its journal), with a bare "No module named 'pyarrow'"."""
    stub = tmp_path / "stub" / "pyarrow"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no pyarrow here')\n")
    prompts = tmp_path / "in.txt"
    prompts.write_text("Hi\n", encoding="utf-8")
    source, out = (prompts, tmp_path / "o.parquet")
    if side == "input":
        source, out = (tmp_path / "in.parquet", tmp_path / "o.jsonl")
        source.write_bytes(b"PAR1")
    command = [sys.executable, "-m", "lmprog", "generate", "--input", str(source)]
    command += ["--output", str(out), "--quiet", "--model", str(tmp_path / "no_such_model")]
    env = {**os.environ, "PYTHONPATH": str(stub.parent)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"{side} {str(source if side == 'input' else out)!r} is Parquet" in proc.stderr
    assert "pip install pyarrow" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not Path(f"{out}.journal.jsonl").exists()


def test_a_module_in_the_current_directory_loads_as_with_python_m(tmp_path, monkeypatch):
    """`lmprog run programs:qa`, the console script, did not find `programs.py` in the
    current directory (its path starts at its own directory), where `python -m lmprog`
    did."""
    from lmprog.cli import load_program

    (tmp_path / "cwd_programs_probe.py").write_text(
        "import lmprog as lp\n\n@lp.function\ndef qa(s, q):\n    s += q + lp.gen('a')\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_programs_probe", raising=False)
    try:
        assert load_program("cwd_programs_probe:qa").func.__name__ == "qa"
    finally:
        sys.modules.pop("cwd_programs_probe", None)


def test_ctrl_c_during_a_slow_compile_exits_at_once(tmp_path):
    """The exit waited for the compile of the cancelled row to time out (a minute by
    default): the command never shut its engine down, and Python's exit joins the compile
    threads before the engine's own at-exit shutdown runs."""
    psutil = pytest.importorskip("psutil")
    source = write_jsonl(tmp_path / "in.jsonl", [{"question": "Code?"}])
    args = ["run", f"{PROGRAMS}:explodes", "--input", str(source), "--quiet"]
    args += ["--output", str(tmp_path / "o.jsonl"), "--engine", "grammar_compile_timeout_s=600"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmprog", *args], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
            "index_child" in " ".join(c.cmdline()) for c in psutil.Process(proc.pid).children()
        ):
            time.sleep(0.1)  # (until the compile runs)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)  # (not the compile's 600 s)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "--resume" in stderr
