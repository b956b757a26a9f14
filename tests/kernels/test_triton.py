"""Triton kernels (TRITON_INTERPRET=1, CPU tensors) against the torch reference backend."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, decode_batch, run_backend

from lmprog_runtime.attention import AttentionLayout
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool, TokenSlotAllocator

pytest.importorskip("triton")


def _setup(heads, kv_heads, head_dim, page_size, seq_lens, seed, window=None):
    """A pool whose requests hold shuffled, paged slots (as after churn), filled randomly."""
    gen = torch.Generator().manual_seed(seed)
    alloc = TokenSlotAllocator(512, page_size)
    # Churn: allocate and free some pages first so slots are not in order.
    junk = [alloc.alloc(page_size * 2) for _ in range(5)]
    for j in junk[::2]:
        alloc.free(j)
    pool = KVPool(
        (alloc.num_pages + 1) * page_size - 1, 1, kv_heads, head_dim, torch.float32, "cpu"
    )
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = ReqToTokenPool(6, 128, "cpu")
    rows = [4, 1, 3, 0][: len(seq_lens)]
    for row, n in zip(rows, seq_lens):
        table.write(row, 0, alloc.alloc(n))
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, window)
    return pool, table, rows, layout, gen


CASES = [  # (heads, kv_heads, head_dim, page_size, prefix_lens, extend_lens, sliding window)
    (4, 4, 64, 1, [0, 3, 17], [5, 9, 2], None),
    (4, 2, 64, 16, [16, 0, 32], [7, 20, 1], None),
    (8, 2, 128, 1, [5, 0], [11, 4], None),
    (4, 1, 128, 16, [0, 48, 16], [33, 3, 16], None),
    # A window shorter than prefixes and extends: keys drop out inside a block and across
    # the cached prefix, in extend and in decode.
    (4, 2, 32, 4, [9, 0, 20], [7, 19, 3], 6),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "prefixes", "extends", "window"), CASES
)
def test_extend_and_decode_match_the_torch_reference(
    heads, kv_heads, head_dim, page_size, prefixes, extends, window
):
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool, table, rows, layout, gen = _setup(
        heads, kv_heads, head_dim, page_size, seq_lens, len(seq_lens), window
    )
    num = sum(extends)
    out_loc = torch.cat([table.table[r, p : p + e] for r, p, e in zip(rows, prefixes, extends)])
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(num, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefixes, extends)]),
        out_cache_loc=out_loc,
        req_pool_indices=torch.tensor(rows),
        seq_lens=seq_lens,
        prefix_lens=prefixes,
        logits_indices=torch.arange(num),
    )
    q = torch.randn(num, heads, head_dim, generator=gen)
    k = torch.randn(num, kv_heads, head_dim, generator=gen)
    v = torch.randn(num, kv_heads, head_dim, generator=gen)
    ref = run_backend("torch", layout, pool, table, batch, q, k, v)
    got = run_backend("triton", layout, pool, table, batch, q, k, v)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    # One decode step on top: each request's next token at position seq_len.
    decode_lens = [n + 1 for n in seq_lens]
    for r, n in zip(rows, seq_lens):
        table.write(r, n, torch.tensor([int(table.table[r, 0])]))  # any valid slot
    batch = decode_batch(table, rows, decode_lens)
    q = torch.randn(len(rows), heads, head_dim, generator=gen)
    k = torch.randn(len(rows), kv_heads, head_dim, generator=gen)
    v = torch.randn(len(rows), kv_heads, head_dim, generator=gen)
    ref = run_backend("torch", layout, pool, table, batch, q, k, v)
    got = run_backend("triton", layout, pool, table, batch, q, k, v)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_wrappers_check_inputs():
    from lmprog_runtime.attention import triton_kernels as tk

    kb = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="dimensions"):
        tk.decode_attention(
            torch.zeros(2, 4, 16),
            kb[0],
            kb,
            torch.zeros(2, 8, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            torch.ones(2, dtype=torch.int64),
            0.25,
        )
    with pytest.raises(ValueError, match="int64"):
        tk.store_kv(
            torch.zeros(1, 2, 16),
            torch.zeros(1, 2, 16),
            kb,
            kb.clone(),
            torch.zeros(1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="head"):
        tk.decode_attention(
            torch.zeros(2, 3, 16),
            kb,
            kb.clone(),
            torch.zeros(2, 8, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            torch.ones(2, dtype=torch.int64),
            0.25,
        )


def test_engine_with_triton_is_token_identical_to_torch(tiny_path):
    from lmprog_runtime import Engine

    outs = {}
    for name in ("torch", "triton"):
        with Engine(tiny_path, attention_backend=name, max_total_tokens=1024) as engine:
            assert engine.runner.attention_backend == name
            result = engine.generate(PROMPTS[:3], {"max_new_tokens": 6, "temperature": 0})
            outs[name] = [o["output_ids"] for o in result]
    assert outs["triton"] == outs["torch"]
