"""The request table's host side and its device mirror.

On an accelerator the scheduler writes the host table and kernels read a device copy that
`sync` brings up to date. No device is needed to check that: a pool whose mirror is a
separate CPU tensor takes the same path (every write logged, applied at `sync`).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.kvcache import ReqToTokenPool

NUM_REQS, CONTEXT_LEN = 4, 16


def _mirrored_pool() -> ReqToTokenPool:
    pool = ReqToTokenPool(NUM_REQS, CONTEXT_LEN, "cpu")
    pool.table = pool.host_table.clone()  # a mirror of its own, as on a GPU
    return pool


write = st.tuples(
    st.integers(0, NUM_REQS - 1),
    st.integers(0, CONTEXT_LEN - 1),
    st.lists(st.integers(1, 1000), min_size=0, max_size=6),
)
write_tokens = st.lists(
    st.tuples(st.integers(0, NUM_REQS - 1), st.integers(0, CONTEXT_LEN - 1), st.integers(1, 99)),
    min_size=1,
    max_size=6,
)
# An extend batch's rows: (row, start, slots) for distinct rows, written with one call.
write_rows = st.lists(write, min_size=1, max_size=NUM_REQS, unique_by=lambda w: w[0])
operation = st.one_of(
    st.tuples(st.just("write"), write),
    st.tuples(st.just("write_tokens"), write_tokens),
    st.tuples(st.just("write_rows"), write_rows),
    st.tuples(st.just("sync"), st.none()),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(operation, max_size=30))
def test_sync_makes_the_mirror_equal_the_host_table(operations):
    pool = _mirrored_pool()
    expected = [[0] * CONTEXT_LEN for _ in range(NUM_REQS + 1)]  # (the reference: lists)
    for name, arg in operations:
        if name == "write":
            row, start, slots = arg
            slots = slots[: CONTEXT_LEN - start]
            expected[row][start : start + len(slots)] = slots
            # (numpy slots, as the prefix cache's, every other write)
            host = np.array(slots, dtype=np.int64) if len(slots) % 2 else torch.tensor(slots)
            pool.write(row, start, host)
        elif name == "write_tokens":
            for row, position, slot in arg:
                expected[row][position] = slot
            rows, positions, slots = (
                torch.tensor(column, dtype=torch.int64, device="cpu") for column in zip(*arg)
            )
            pool.write_tokens(rows, positions, slots)
        elif name == "write_rows":
            arg = [(row, start, slots[: CONTEXT_LEN - start]) for row, start, slots in arg]
            for row, start, slots in arg:
                expected[row][start : start + len(slots)] = slots
            rows, starts, counts = (
                [w[0] for w in arg],
                [w[1] for w in arg],
                [len(w[2]) for w in arg],
            )
            flat = torch.tensor([s for w in arg for s in w[2]], dtype=torch.int64)
            pool.write_rows(rows, starts, counts, flat)
        else:
            pool.sync()
            assert torch.equal(pool.table, pool.host_table)
        assert pool.host_table.tolist() == expected
    pool.sync()
    assert torch.equal(pool.table, pool.host_table)


def test_the_padding_row_is_never_handed_out_and_stays_zero():
    pool = ReqToTokenPool(NUM_REQS, CONTEXT_LEN, "cpu")
    rows = [pool.alloc() for _ in range(NUM_REQS)]
    assert pool.alloc() is None
    assert pool.padding_row not in rows
    for row in rows:
        pool.write(row, 0, torch.arange(1, CONTEXT_LEN + 1, device="cpu"))
    assert not pool.table[pool.padding_row].any()


def test_a_cpu_pool_has_one_table():
    pool = ReqToTokenPool(NUM_REQS, CONTEXT_LEN, "cpu")
    assert pool.table is pool.host_table
    pool.write(0, 2, torch.tensor([7, 8], device="cpu"))
    pool.sync()  # nothing to do
    assert pool.table[0, :4].tolist() == [0, 0, 7, 8]
