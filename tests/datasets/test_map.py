"""`Function.map` on the tiny model: every input kind gives, row for row, what `run()` gives
for that row alone; bad rows fail alone; windows bound memory; cache-aware order groups rows
by prompt prefix; the progress bar. The reference is `run()` (greedy), one row at a time."""

from __future__ import annotations

import csv
import threading

import pytest
from map_programs import GREEDY, SYSTEMS, expected_row, ideas, make_rows, qa, write_jsonl

import lmprog as lp

NUM_ROWS = 500


@pytest.fixture(scope="module")
def rows():
    return make_rows(NUM_ROWS)


@pytest.fixture(scope="module")
def expected(rows, _session_engine):
    """run() on each row alone, keyed by its (unique) question."""
    return {r["question"]: expected_row(qa, r, _session_engine) for r in rows}


def check_rows(out, rows, expected, *, id_type=int):
    assert len(out) == len(rows)
    for got, row in zip(out, rows):
        assert got["id"] == id_type(row["id"]) and got["question"] == row["question"]
        assert got["system"] == row["system"]
        want = expected[row["question"]]
        assert {k: got[k] for k in want} == want, (row, got)


def write_csv(path, rows):
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_jsonl_input_to_parquet_output(engine, rows, expected, tmp_path):
    import pyarrow.parquet as pq

    source = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = qa.map(source, output=tmp_path / "out.parquet", backend=engine, **GREEDY).run()
    assert (summary.num_rows, summary.num_errors, summary.num_skipped) == (NUM_ROWS, 0, 0)
    assert not (tmp_path / "out.parquet.journal.jsonl").exists()
    table = pq.read_table(tmp_path / "out.parquet")
    assert str(table.schema.field("ret_value").type) == "bool"
    check_rows(table.to_pylist(), rows, expected)
    assert [r["row_index"] for r in table.to_pylist()] == list(range(NUM_ROWS))


def test_csv_input_to_jsonl_output(engine, rows, expected, tmp_path):
    from map_programs import read_jsonl

    source = write_csv(tmp_path / "in.csv", rows)
    out = tmp_path / "out.jsonl"
    qa.map(source, output=out, id_column="id", backend=engine, **GREEDY).run()
    check_rows(read_jsonl(out), rows, expected, id_type=str)  # CSV values are strings


def test_parquet_input_to_an_iterator(engine, rows, expected, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=100)
    out = list(qa.map(tmp_path / "in.parquet", backend=engine, **GREEDY))
    check_rows(out, rows, expected)


def test_pandas_and_datasets_give_the_same_rows(engine, rows, expected):
    import datasets
    import pandas as pd

    df = pd.DataFrame(rows[:120])
    from_pandas = list(qa.map(df, backend=engine, **GREEDY))
    from_hf = list(qa.map(datasets.Dataset.from_pandas(df), backend=engine, **GREEDY))
    from_list = list(qa.map(rows[:120], backend=engine, **GREEDY))
    assert from_pandas == from_hf == from_list
    check_rows(from_pandas, rows[:120], expected)
    assert all(type(r["id"]) is int for r in from_pandas)  # numpy scalars made plain


def test_fork_values_are_list_columns(engine, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"topic": t} for t in ("tea", "trains", "the sea", "tea")]
    qa_out = tmp_path / "ideas.parquet"
    ideas.map(rows, output=qa_out, backend=engine, **GREEDY).run()
    table = pq.read_table(qa_out)
    idea_type = table.schema.field("idea").type
    assert pa.types.is_list(idea_type) and idea_type.value_type == pa.string()
    for got, row in zip(table.to_pylist(), rows):
        assert {k: got[k] for k in ("idea", "ret_value", "error")} == expected_row(
            ideas, row, engine
        )


def test_bad_rows_fail_alone(engine, rows, expected):
    too_long = " word" * (engine.context_len + 10)
    bad = {
        3: {"id": -1, "system": SYSTEMS[0], "question": too_long},
        10: {"id": -2, "system": SYSTEMS[1], "question": "raise, please"},
        20: {"id": -3, "system": SYSTEMS[2]},  # no question column
    }
    data = list(rows[:60])
    for i, row in bad.items():
        data.insert(i, row)
    out = list(qa.map(data, backend=engine, **GREEDY))
    assert len(out) == len(data)
    assert out[3]["error"] == expected_row(qa, bad[3], engine)["error"]
    assert str(engine.context_len) in out[3]["error"]
    assert out[10]["error"] == "RuntimeError: the program raised on 'raise, please'"
    assert out[20]["error"] == "KeyError: row has no column 'question' for the argument of qa()"
    good = [(got, row) for i, (got, row) in enumerate(zip(out, data)) if i not in bad]
    check_rows([g for g, _ in good], [r for _, r in good], expected)


@lp.function
def checks_its_answer(s, question):
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=3))
    answer = s["answer"]
    s["stage"] = "checked"
    if question.startswith("raise"):
        raise ValueError(f"the answer {answer!r} did not parse")
    s["stage"] = "done"


def test_a_row_that_raises_keeps_the_variables_set_before_the_raise(engine):
    """A program that raises: its row holds what the body set before the raise (a
    variable set right before the raise was lost)."""
    data = [{"question": q} for q in ("raise now", "fine", "raise again")]
    out = list(checks_its_answer.map(data, backend=engine, **GREEDY))
    for row in out:
        state = checks_its_answer.run(
            question=row["question"], backend=engine, stream=True, **GREEDY
        )
        state.sync()
        assert row["answer"] == state["answer"]
        if row["question"] == "fine":
            assert (row["stage"], row["error"]) == ("done", None)
        else:
            assert row["stage"] == "checked" == state["stage"]
            assert row["error"] == f"ValueError: the answer {state['answer']!r} did not parse"


def test_unordered_yields_every_row_once(engine, rows, expected):
    out = list(qa.map(rows[:200], ordered=False, backend=engine, **GREEDY))
    assert sorted(r["row_index"] for r in out) == list(range(200))
    by_index = sorted(out, key=lambda r: r["row_index"])
    check_rows(by_index, rows[:200], expected)


def test_windows_bound_the_rows_held(engine):
    """Rows are read a window at a time: never more than two windows ahead of the rows
    that came out, and the first result comes before the source is read to its end."""
    window, num_rows = 16, 300
    pulled = []

    def source():
        for i in range(num_rows):
            pulled.append(i)
            yield {"question": f"Item {i}?", "system": SYSTEMS[i % 8]}

    ahead = []
    for n, _ in enumerate(qa.map(source(), window=window, backend=engine, **GREEDY), 1):
        ahead.append(len(pulled) - n)
    assert len(ahead) == num_rows
    assert max(ahead) < 2 * window, max(ahead)
    assert ahead[0] < num_rows - 1


def test_cache_aware_order_runs_rows_with_a_shared_prefix_together(engine):
    started = []
    lock = threading.Lock()

    @lp.function
    def noted(s, system, question):
        if isinstance(system, str):  # not the one symbolic trace that finds the template
            with lock:
                started.append(system)
        s += lp.system(system) + lp.user(question)
        s += lp.assistant(lp.gen("answer", max_tokens=2))

    data = [{"system": SYSTEMS[i % 4], "question": f"Q{i}"} for i in range(64)]
    sorted_out = list(noted.map(data, num_threads=1, window=32, backend=engine, **GREEDY))
    assert len(started) == len(data)  # each body once with its row
    switches = sum(a != b for a, b in zip(started, started[1:]))
    assert switches == 2 * 4 - 1  # each window of 32 runs its 4 prompts one after another
    started.clear()
    plain_out = list(noted.map(data, num_threads=1, cache_aware=False, backend=engine, **GREEDY))
    assert started == [d["system"] for d in data]
    assert sorted_out == plain_out  # results in input order either way


def test_cache_aware_order_keeps_a_small_cache_hot(engine, tiny_path):
    """A pool that holds about two prompts: in input order (4 system prompts interleaved)
    they keep evicting each other; grouped, each is computed about once."""
    from lmprog_runtime import Engine

    @lp.function
    def one(s, system, question):
        s += lp.system(system) + lp.user(question)
        s += lp.assistant(lp.gen("answer", max_tokens=2))

    data = [r for r in make_rows(96) if r["system"] in SYSTEMS[:4]]
    messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Q?"}]
    prompt_len = len(engine.encode(engine.tokenizer.apply_chat_template(messages, tokenize=False)))
    pool = int(2.5 * prompt_len)
    with Engine(tiny_path, max_total_tokens=pool, max_running_requests=2) as small:
        cached = {}
        for cache_aware in (False, True):
            small.flush_cache()
            out = list(
                one.map(
                    data,
                    cache_aware=cache_aware,
                    num_threads=2,
                    include_usage=True,
                    backend=small,
                    **GREEDY,
                )
            )
            assert [r["answer"] for r in out] == [
                expected_row(one, r, engine)["answer"] for r in data
            ]
            cached[cache_aware] = sum(r["cached_tokens"] for r in out)
    assert cached[True] > 1.5 * cached[False], cached


def test_usage_columns_count_every_request(engine):
    """A row's counts add up its requests' meta info; over a map of one-gen programs they
    are the engine's own counters. (A request group, as a select's choices, is prefilled
    behind an internal request of the engine's, which no row's counts include.)"""

    @lp.function
    def one(s, system, question):
        s += lp.system(system) + lp.user(question)
        s += lp.assistant(lp.gen("answer", max_tokens=5, ignore_eos=True))

    data = make_rows(40)
    for program, is_exact in ((one, True), (qa, False)):
        engine.reset_stats()
        out = list(program.map(data, include_usage=True, backend=engine, **GREEDY))
        stats = engine.stats()
        cached = sum(r["cached_tokens"] for r in out)
        computed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in out)
        if is_exact:
            assert (cached, computed) == (stats["cached_tokens"], stats["prefill_tokens"])
            # the first token of each gen comes from its prefill, the others from decodes
            assert sum(r["completion_tokens"] for r in out) == stats["decode_tokens"] + len(data)
        else:
            assert 0 < cached <= stats["cached_tokens"]
            assert 0 < computed <= stats["prefill_tokens"]


def test_progress_bar(engine, capfd):
    data = make_rows(30) + [{"id": 99, "system": SYSTEMS[0]}]
    list(qa.map(data, progress=True, backend=engine, **GREEDY))
    err = capfd.readouterr().err
    assert "31/31" in err and "row/s" in err
    assert "tok/s" in err and "cache hit" in err and "errors 1" in err
    list(qa.map(data, backend=engine, **GREEDY))
    assert capfd.readouterr().err == ""


def test_variables_named_like_input_columns_keep_both(engine):
    @lp.function
    def echo(s, question):
        s["question"] = question.upper()
        s += question + lp.gen("answer", max_tokens=2)

    (row,) = list(echo.map([{"question": "hi", "other": 1}], backend=engine, **GREEDY))
    assert row["question"] == "hi" and row["var_question"] == "HI" and row["other"] == 1
    # An input column named var_question is kept too (the variable once overwrote it).
    rows = [{"question": "hi", "var_question": "mine"}]
    (row,) = list(echo.map(rows, backend=engine, **GREEDY))
    assert (row["var_question"], row["var_var_question"]) == ("mine", "HI")


def test_a_program_with_var_keywords_takes_the_columns_no_parameter_takes(engine):
    @lp.function
    def ask(s, question, /, tone="plain", **columns):
        s["seen"] = sorted(columns)
        s += f"{tone}: {question} {columns['user name']}" + lp.gen("answer", max_tokens=2)

    rows = [{"question": "hi", "user name": "Ada", "tone": "dry", "id": 3, "s": "not the state"}]
    (row,) = list(ask.map(rows, backend=engine, **GREEDY))
    assert row["error"] is None and row["seen"] == ["id", "user name"]
    alone = ask.run("hi", tone="dry", **{"user name": "Ada", "id": 3}, backend=engine, **GREEDY)
    assert row["answer"] == alone["answer"]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_file_that_starts_with_a_byte_order_mark_reads_its_first_column(engine, tmp_path, suffix):
    """Excel's "CSV UTF-8" starts with a BOM: the first column was once '\\ufeffquestion'."""

    @lp.function
    def echo(s, question):
        s += question + lp.gen("answer", max_tokens=2)

    path = tmp_path / f"in{suffix}"
    text = "question\nhi\n" if suffix == ".csv" else '{"question": "hi"}\n'
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    (row,) = list(echo.map(path, backend=engine, **GREEDY))
    assert row["question"] == "hi" and row["error"] is None
