"""Bad arguments to `Function.map` fail at the call, before any row runs, with an error
that names the parameter (or the column) at fault."""

from __future__ import annotations

import pytest
from map_programs import make_rows, qa, write_jsonl


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", make_rows(5))


def bad_calls(tmp_path, jsonl):
    import pandas as pd

    df = pd.DataFrame(make_rows(5))
    existing = write_jsonl(tmp_path / "done.jsonl", [{"row_index": 0}])
    return [
        ((42,), {}, TypeError, "data must be"),
        (({"question": "q"},), {}, TypeError, "not one dict"),
        (([{"question": "q"}, "q"],), {}, TypeError, r"data\[1\] must be a dict"),
        ((tmp_path / "in.txt",), {}, ValueError, "data path .* must end in"),
        ((tmp_path / "missing.jsonl",), {}, FileNotFoundError, "does not exist"),
        ((jsonl,), {"output": tmp_path / "o.csv"}, ValueError, "output .* must end in"),
        ((jsonl,), {"output": 5}, TypeError, "output must be a path, got int"),
        ((jsonl,), {"output": existing}, ValueError, "already exists: pass resume=True"),
        ((jsonl,), {"resume": True}, ValueError, "resume=True needs an output"),
        ((jsonl,), {"resume": 1}, TypeError, "resume must be a bool"),
        ((jsonl,), {"window": 0}, ValueError, "window must be a positive int"),
        ((jsonl,), {"num_threads": -1}, ValueError, "num_threads must be"),
        ((jsonl,), {"id_column": 3}, TypeError, "id_column must be a column name"),
        ((jsonl,), {"question": "q"}, TypeError, r"unknown keyword arguments \['question'\]"),
        # Sampling defaults checked as gen checks them (they were every row's error).
        ((jsonl,), {"temperature": -1.0}, ValueError, "temperature"),
        ((jsonl,), {"return_logprob": "no"}, TypeError, "return_logprob"),
        ((jsonl,), {"stop_token_ids": [10**9]}, None, None),  # the engine's, per request
        ((df,), {"id_column": "key"}, ValueError, "id_column 'key' is not a column"),
        ((df[["id", "system"]],), {}, ValueError, "no column 'question' for the argument"),
        ((df.assign(error=1),), {}, ValueError, r"column\(s\) \['error'\], which the output"),
        ((df.assign(text=1),), {"include_text": True}, ValueError, r"\['text'\]"),
    ]


def test_bad_arguments_fail_before_any_row_runs(engine, tmp_path, jsonl):
    (tmp_path / "in.txt").write_text("x\n")
    engine.reset_stats()
    for args, kwargs, error, match in bad_calls(tmp_path, jsonl):
        if error is None:
            continue
        with pytest.raises(error, match=match):
            qa.map(*args, backend=engine, **kwargs)
    assert engine.stats()["finished_requests"] == 0


def test_a_sampling_value_the_engine_refuses_fails_each_row_not_the_map(engine, jsonl):
    rows = list(qa.map(jsonl, backend=engine, stop_token_ids=[10**9]))
    assert len(rows) == 5
    assert all(r["error"].startswith("ValueError") and "stop_token_ids" in r["error"] for r in rows)


def test_an_input_column_clashing_mid_stream_is_refused(engine):
    rows = [*make_rows(3), {"question": "q", "system": "s", "ret_value": 1}]
    with pytest.raises(ValueError, match=r"row 3: input column\(s\) \['ret_value'\] clash"):
        list(qa.map(iter(rows), backend=engine, temperature=0))
