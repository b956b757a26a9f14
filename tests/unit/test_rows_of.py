"""`RowsOf`: a forward's logits rows by request, read in the batch's order without a dict,
in any other order through one."""

from __future__ import annotations

from lmprog_runtime.forward_batch import RowsOf


def test_last_rows_in_any_order_equal_a_dict_by_request():
    reqs = [object() for _ in range(4)]
    rows = [[0, 1, 2], [3], [4, 5], [6]]
    rows_of = RowsOf(reqs, rows)
    by_id = {id(req): r for req, r in zip(reqs, rows)}
    for asked in (reqs, reqs[::-1], reqs[1:3], [reqs[2], reqs[0], reqs[3], reqs[1]], []):
        assert rows_of.last_rows(asked) == [by_id[id(req)][-1] for req in asked]
    assert rows_of[id(reqs[2])] == [4, 5]


def test_one_row_each_reads_as_the_list_it_stands_for():
    import pytest

    from lmprog_runtime.forward_batch import OneRowEach

    for n in (0, 1, 5):
        rows, want = OneRowEach(n), [[i] for i in range(n)]
        assert len(rows) == n and list(rows) == want and rows[1:3] == want[1:3]
        assert [rows[i] for i in range(-n, n)] == [want[i] for i in range(-n, n)]
        with pytest.raises(IndexError):
            rows[n]
        reqs = [object() for _ in range(n)]
        rows_of = RowsOf(reqs, rows)
        for asked in (reqs, reqs[::-1], reqs[1:]):
            assert rows_of.last_rows(asked) == RowsOf(reqs, want).last_rows(asked)
