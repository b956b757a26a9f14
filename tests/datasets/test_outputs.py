"""What an output file holds: every row, each value as it was where the format can hold it
(read back with `json.loads` and `pyarrow`, compared with the input values), and a row JSON
cannot hold as it is fails alone, with an `error`, never the map."""

from __future__ import annotations

import datetime
import decimal
import json
import math

import pytest
from map_programs import GREEDY, read_jsonl

import lmprog as lp


@lp.function
def returns(s, v):
    """Returns the row's `v` column decoded from JSON (or as it is, when not a string)."""
    s += "x"
    return json.loads(v) if isinstance(v, str) else v


@lp.function
def unwritable(s, q):
    """A gen, then a return value JSON cannot hold for some rows."""
    s += q + lp.gen("answer", max_tokens=2)
    if q == "tuple key":
        return {(1, 2): "x"}
    if q == "holds itself":
        itself = []
        itself.append(itself)
        return itself
    return q


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_row_json_cannot_hold_fails_alone_and_the_others_are_written(engine, tmp_path, suffix):
    import pyarrow.parquet as pq

    questions = ["good 1", "a lone surrogate \ud800", "tuple key", "holds itself", "good 2"]
    rows = [{"id": i, "q": q} for i, q in enumerate(questions)]
    out = tmp_path / f"out{suffix}"
    summary = unwritable.map(rows, output=out, id_column="id", backend=engine, **GREEDY).run()
    assert (summary.num_rows, summary.num_errors) == (5, 3)
    written = read_jsonl(out) if suffix == ".jsonl" else pq.read_table(out).to_pylist()
    by_id = {r["id"]: r for r in written}
    assert sorted(by_id) == [0, 1, 2, 3, 4]
    for i in (0, 4):
        assert by_id[i]["error"] is None and by_id[i]["q"] == questions[i]
    assert by_id[1]["q"] == "a lone surrogate \ufffd" and "lone surrogate" in by_id[1]["error"]
    assert "dict key of type tuple" in by_id[2]["error"]
    assert "holds itself" in by_id[3]["error"]
    ret = [by_id[i]["ret_value"] for i in (2, 3)]
    if suffix == ".parquet":  # (a column of mixed types: JSON text)
        ret = [json.loads(v) for v in ret]
    assert ret == [{"(1, 2)": "x"}, [None]]
    again = unwritable.map(rows, output=out, id_column="id", resume=True, backend=engine)
    assert again.run().num_skipped == 5  # resumable: each row once


def test_nan_and_infinity_are_written_as_null(engine, tmp_path):
    out = tmp_path / "out.jsonl"
    rows = [{"v": math.nan}, {"v": [1.5, math.inf]}]
    returns.map(rows, output=out, backend=engine).run()
    lines = out.read_text(encoding="utf-8").splitlines()
    assert all("NaN" not in line and "Infinity" not in line for line in lines)
    written = [json.loads(line) for line in lines]
    assert [(r["v"], r["ret_value"], r["error"]) for r in written] == [
        (None, None, None),
        ([1.5, None], [1.5, None], None),
    ]


def test_an_upper_case_parquet_suffix_writes_parquet(engine, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "out.PARQUET"
    returns.map([{"v": "1"}, {"v": "2"}], output=out, backend=engine).run()
    assert [r["ret_value"] for r in pq.read_table(out).to_pylist()] == [1, 2]
    assert not (tmp_path / "out.PARQUET.journal.jsonl").exists()


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(["{}", "{}"], id="empty-dicts"),
        pytest.param(["[{}]", "[]"], id="lists-of-empty-dicts"),
        pytest.param([str(2**53 + 1)] * 4096 + ["0.5"], id="wide-ints-then-a-float"),
        pytest.param(['{"a": 1}', '{"b": "x"}', "{}"], id="dicts-with-other-keys"),
        pytest.param(["1", '"1"', "[1]", "null"], id="mixed-types"),
    ],
)
def test_parquet_holds_every_value_as_it_was(engine, tmp_path, values):
    """Columns no Arrow type holds exactly are JSON text, every value (strings too), named
    in the file's metadata; resuming the finished file reads them back as they were."""
    import pyarrow.parquet as pq

    out = tmp_path / "out.parquet"
    rows = [{"v": v} for v in values]
    returns.map(rows, output=out, backend=engine).run()
    table = pq.read_table(out)
    json_columns = json.loads((table.schema.metadata or {}).get(b"lmprog.json_columns", "[]"))
    got = table.column("ret_value").to_pylist()
    if "ret_value" in json_columns:
        got = [None if v is None else json.loads(v) for v in got]
    assert got == [json.loads(v) for v in values]
    assert all(type(g) is type(json.loads(v)) for g, v in zip(got, values))

    more = [*rows, {"v": '"new"'}]  # a resumed run copies the file into its journal
    assert returns.map(more, output=out, resume=True, backend=engine).run().num_rows == 1
    table = pq.read_table(out)
    got = [json.loads(v) if v is not None else None for v in table.column("ret_value").to_pylist()]
    assert got == [json.loads(v) for v in values] + ["new"]


def test_parquet_keeps_binary_temporal_and_decimal_types(engine, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": [1, 2],
            "v": ["1", "2"],
            "blob": pa.array([b"\x00\xff", b"hi"], pa.binary()),
            "ts": pa.array([datetime.datetime(2024, 1, 1, 12, 0, 0, 5), None], pa.timestamp("us")),
            "day": pa.array([datetime.date(2024, 1, 2), datetime.date(2024, 2, 3)]),
            "price": pa.array([decimal.Decimal("1.10"), decimal.Decimal("2.25")]),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    returns.map(tmp_path / "in.parquet", output=out, id_column="id", backend=engine).run()
    got = pq.read_table(out)
    for name in ("blob", "ts", "day", "price"):
        assert got.schema.field(name).type == table.schema.field(name).type, name
        assert got.column(name).to_pylist() == table.column(name).to_pylist(), name


def test_the_journal_reads_nanosecond_times_back():
    """A pandas Timestamp writes nanoseconds; Python 3.10's fromisoformat refused them (the
    Parquet file was never written), 3.11 on cut them to microseconds: now every version."""
    from lmprog.datasets.parquet import _TAGGED

    read_datetime, read_time = _TAGGED["$lmprog.datetime"][1], _TAGGED["$lmprog.time"][1]
    assert read_datetime("2024-01-01T12:00:00.000001999") == datetime.datetime(
        2024, 1, 1, 12, 0, 0, 1
    )
    assert read_time("12:00:00.123456789") == datetime.time(12, 0, 0, 123456)


def test_a_csv_row_with_more_cells_than_the_header_is_an_input_error(engine, tmp_path):
    @lp.function
    def ask(s, q, **columns):
        s += q + lp.gen("answer", max_tokens=2)

    source = tmp_path / "in.csv"
    source.write_text("q,id\nfirst,1\nsecond,2,extra\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"in\.csv:3: 3 cells, but the header names 2 columns"):
        list(ask.map(source, backend=engine, **GREEDY))
