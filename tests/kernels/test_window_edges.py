"""Sliding-window edges of each backend against a naive softmax: requests whose length is
exactly window + 1 (all equal, so no per-request mask is needed for causality), where a
shortcut that skips the mask must still apply the window. The existing window tests mix
lengths, so a mask is always built."""

from __future__ import annotations

import pytest
import torch
from helpers import run_backend

from lmprog_runtime.attention import AttentionLayout
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool

HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 16, 8


def _naive(q, keys, values, q_pos, scale):
    """q [heads, dim] at position q_pos; keys/values [len, kv_heads, dim] (positions 0..)."""
    group = HEADS // KV_HEADS
    out = []
    for h in range(HEADS):
        k, v = keys[:, h // group], values[:, h // group]
        pos = torch.arange(k.shape[0])
        s = (k @ q[h]) * scale
        s = s.masked_fill(~((pos <= q_pos) & (pos > q_pos - WINDOW)), float("-inf"))
        out.append(torch.softmax(s, 0) @ v)
    return torch.cat(out)


def _setup(lens, prefixes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layout = AttentionLayout(HEADS, KV_HEADS, DIM, DIM**-0.5, WINDOW)
    total = sum(lens)
    pool = KVPool(total + 8, 1, KV_HEADS, DIM, torch.float32, "cpu")
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = ReqToTokenPool(len(lens) + 1, max(lens), "cpu")
    slots, rows, off = torch.arange(1, total + 1), [], 0
    for i, n in enumerate(lens):
        table.write(i, 0, slots[off : off + n])
        rows.append(i)
        off += n
    ext = [n - p for n, p in zip(lens, prefixes)]
    num = sum(ext)
    mode = ForwardMode.DECODE if all(e == 1 for e in ext) else ForwardMode.EXTEND
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, n) for p, n in zip(prefixes, lens)]),
        out_cache_loc=torch.cat([table.table[r, p:n] for r, p, n in zip(rows, prefixes, lens)]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=list(lens),
        prefix_lens=list(prefixes),
        logits_indices=torch.arange(num),
        seq_lens_device=torch.tensor(lens),
    )
    q = torch.randn(num, HEADS, DIM, generator=gen)
    k = torch.randn(num, KV_HEADS, DIM, generator=gen)
    v = torch.randn(num, KV_HEADS, DIM, generator=gen)
    return layout, pool, table, batch, q, k, v


def _expected(layout, pool, table, batch, q, k, v):
    pool.k_buffers[0][batch.out_cache_loc] = k  # (what the backend writes first)
    pool.v_buffers[0][batch.out_cache_loc] = v
    out, t = [], 0
    for i, (n, p) in enumerate(zip(batch.seq_lens, batch.prefix_lens)):
        slots = table.table[i, :n]
        keys, values = pool.k_buffers[0][slots], pool.v_buffers[0][slots]
        for pos in range(p, n):
            out.append(_naive(q[t], keys, values, pos, layout.scaling))
            t += 1
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize(
    "lens, prefixes",
    [
        ([WINDOW + 1, WINDOW + 1], [WINDOW, WINDOW]),  # decode, equal lengths
        ([WINDOW + 1], [0]),  # one fresh prompt of window + 1 tokens
        ([WINDOW + 1, WINDOW + 1], [0, 0]),  # fresh, equal lengths
    ],
)
def test_length_window_plus_one_sees_window_keys(backend, lens, prefixes):
    setup = _setup(lens, prefixes)
    got = run_backend(backend, *setup)
    setup2 = _setup(lens, prefixes)  # (a fresh pool: the backend wrote into the first)
    want = _expected(*setup2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
