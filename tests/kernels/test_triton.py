"""Triton kernels (TRITON_INTERPRET=1, CPU tensors) against the torch reference backend.

The reference runs in float32. float32 kernels multiply in full float32 and are held to
1e-4. bfloat16 kernels read the same values rounded to bfloat16 (the reference gets those
rounded values too) and accumulate in float32; they round the output once (at most 2^-9
relative: rtol=2^-7 with margin) and, on tensor cores, the softmax weights before the value
product (at most 2^-9 of outputs of order one: atol=4e-3; the interpreter keeps them in
float32). A lost or extra key, a wrong head or a wrong slot moves outputs by far more:
queries are drawn at twice unit scale, so attention is peaked and every key matters.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from helpers import PROMPTS, run_backend
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.attention import AttentionLayout
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool, TokenSlotAllocator

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=2**-7, atol=4e-3),
}


class Setup(NamedTuple):
    ref_pool: KVPool  # float32, the reference's
    pool: KVPool  # the kernels' dtype, the same values
    table: ReqToTokenPool
    rows: list[int]
    layout: AttentionLayout
    gen: torch.Generator


def _setup(heads, kv_heads, head_dim, page_size, seq_lens, seed, window=None, dtype=torch.float32):
    """Pools whose requests hold shuffled, paged slots (as after churn), filled randomly;
    each request's table row is long enough for one more (decode) token."""
    gen = torch.Generator().manual_seed(seed)
    alloc = TokenSlotAllocator(2048, page_size)
    # Churn: allocate and free some pages first so slots are not in order.
    junk = [alloc.alloc(page_size * 2) for _ in range(5)]
    for j in junk[::2]:
        alloc.free(j)
    num_slots = (alloc.num_pages + 1) * page_size - 1
    ref_pool = KVPool(num_slots, 1, kv_heads, head_dim, torch.float32, "cpu")
    pool = KVPool(num_slots, 1, kv_heads, head_dim, dtype, "cpu")
    for ref, buf in zip(ref_pool.k_buffers + ref_pool.v_buffers, pool.k_buffers + pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen))
        ref.copy_(buf)
    table = ReqToTokenPool(len(seq_lens) + 2, 512, "cpu")
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)].tolist()
    for row, n in zip(rows, seq_lens):
        table.write(row, 0, alloc.alloc(n + 1))
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, window)
    return Setup(ref_pool, pool, table, rows, layout, gen)


def _batch(s: Setup, prefixes, extends, num_decodes=0, mode=ForwardMode.EXTEND) -> ForwardBatch:
    num = sum(extends)
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefixes, extends)]),
        out_cache_loc=torch.cat(
            [s.table.table[r, p : p + e] for r, p, e in zip(s.rows, prefixes, extends)]
        ),
        req_pool_indices=torch.tensor(s.rows),
        seq_lens=[p + e for p, e in zip(prefixes, extends)],
        prefix_lens=list(prefixes),
        logits_indices=torch.arange(num),
        num_decodes=num_decodes,
    )


def _check_layer(s: Setup, batch: ForwardBatch, dtype: torch.dtype) -> None:
    """One attention layer of `batch` through the triton backend (pool and q, k, v in
    `dtype`) and through the torch reference (float32, the same values)."""
    n, layout = batch.num_tokens, s.layout
    q = 2 * torch.randn(n, layout.num_heads, layout.head_dim, generator=s.gen)
    k = torch.randn(n, layout.num_kv_heads, layout.head_dim, generator=s.gen)
    v = torch.randn(n, layout.num_kv_heads, layout.head_dim, generator=s.gen)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = run_backend("triton", layout, s.pool, s.table, batch, q, k, v)
    ref = run_backend("torch", layout, s.ref_pool, s.table, batch, q.float(), k.float(), v.float())
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, **TOLERANCE[dtype])


CASES = [  # (heads, kv_heads, head_dim, page_size, prefix_lens, extend_lens, sliding window)
    (4, 4, 64, 1, [0, 3, 17], [5, 9, 2], None),
    (4, 2, 64, 16, [16, 0, 32], [7, 20, 1], None),
    (8, 2, 128, 1, [5, 0], [11, 4], None),
    # 130 new tokens span several default query tiles (64 rows in float32, 128 in bfloat16).
    (4, 1, 128, 16, [0, 48, 16], [130, 3, 16], None),
    # A window shorter than prefixes and extends: keys drop out inside a block and across
    # the cached prefix, in extend and in decode.
    (4, 2, 32, 4, [9, 0, 20], [7, 19, 3], 6),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "prefixes", "extends", "window"), CASES
)
def test_extend_and_decode_match_the_torch_reference(
    heads, kv_heads, head_dim, page_size, prefixes, extends, window, dtype
):
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    s = _setup(heads, kv_heads, head_dim, page_size, seq_lens, len(seq_lens), window, dtype)
    _check_layer(s, _batch(s, prefixes, extends), dtype)
    # One decode step on top: each request's next token at position seq_len.
    _check_layer(s, _batch(s, seq_lens, [1] * len(seq_lens), mode=ForwardMode.DECODE), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "window"), [(2, None), (8, None), (1, 40)])
def test_mixed_extend_with_decodes_matches_the_torch_reference(kv_heads, window, dtype):
    # Two new prompts (one after a cached prefix) and three running requests decoding one
    # token each, one of them longer than the window.
    prefixes, extends = [0, 20, 4, 150, 60], [23, 9, 1, 1, 1]
    s = _setup(8, kv_heads, 32, 16, [p + e for p, e in zip(prefixes, extends)], 7, window, dtype)
    batch = _batch(s, prefixes, extends, num_decodes=3)
    _check_layer(s, batch, dtype)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[str, int, tuple]]:
    """(kernel, rows of q, positional arguments) of each attention kernel the backend runs."""
    from lmprog_runtime.attention import triton_decode, triton_kernels

    calls = []

    def spy(module, name: str) -> None:
        kernel = getattr(module, name)

        def run(q, *args, **kwargs):
            calls.append((name, q.shape[0], args))
            return kernel(q, *args, **kwargs)

        monkeypatch.setattr(module, name, run)

    spy(triton_kernels, "extend_attention")
    spy(triton_decode, "decode_attention")
    return calls


def test_mixed_extend_runs_its_decodes_with_the_decode_kernel(kernel_calls):
    s = _setup(4, 2, 16, 1, [5, 9, 12], 3)
    batch = _batch(s, [0, 8, 11], [5, 1, 1], num_decodes=2)
    q, k, v = (torch.randn(7, h, 16, generator=s.gen) for h in (4, 2, 2))
    run_backend("triton", s.layout, s.pool, s.table, batch, q, k, v)
    assert [call[:2] for call in kernel_calls] == [("extend_attention", 5), ("decode_attention", 2)]


def test_graph_batches_are_planned_from_device_lengths_and_batch_size(kernel_calls):
    """CUDA-graph decode batches as a capture sees them: host lengths of 1, the real ones on
    the device only. The split count depends on the batch size alone (one launch shape per
    graph) and the output on the device lengths."""
    from lmprog_runtime.attention.triton_decode import choose_num_splits

    for seed, seq_lens in enumerate([[3, 200, 41], [90, 1, 7]]):
        s = _setup(8, 2, 32, 16, seq_lens, seed)
        real = _batch(s, [n - 1 for n in seq_lens], [1, 1, 1], mode=ForwardMode.DECODE)
        graph = dataclasses.replace(
            real,
            seq_lens=[1, 1, 1],
            prefix_lens=[0, 0, 0],
            seq_lens_device=torch.tensor(seq_lens),
            is_cuda_graph=True,
        )
        q = 2 * torch.randn(3, 8, 32, generator=s.gen)
        k, v = (buf[0][real.out_cache_loc] for buf in (s.pool.k_buffers, s.pool.v_buffers))
        got = run_backend("triton", s.layout, s.pool, s.table, graph, q, k, v)
        torch.testing.assert_close(got.view(q.shape), _reference(s, real, q), **TOLERANCE[q.dtype])
    num_splits = choose_num_splits(3, 2, s.table.context_len)
    assert [args[-1] for _, _, args in kernel_calls] == [num_splits, num_splits]


def test_wrappers_check_inputs():
    from lmprog_runtime.attention import triton_decode as td
    from lmprog_runtime.attention import triton_kernels as tk

    kb = torch.zeros(8, 2, 16)
    index = (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    lens = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="dimensions"):
        td.decode_attention(torch.zeros(2, 4, 16), kb[0], kb, *index, lens, 0.25)
    with pytest.raises(ValueError, match="int64"):
        tk.store_kv(
            torch.zeros(1, 2, 16),
            torch.zeros(1, 2, 16),
            kb,
            kb.clone(),
            torch.zeros(1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="head"):
        td.decode_attention(torch.zeros(2, 3, 16), kb, kb.clone(), *index, lens, 0.25)
    with pytest.raises(ValueError, match="share one of"):
        td.decode_attention(torch.zeros(2, 4, 16).bfloat16(), kb, kb.clone(), *index, lens, 0.25)
    with pytest.raises(ValueError, match="num_splits"):
        td.decode_attention(torch.zeros(2, 4, 16), kb, kb.clone(), *index, lens, 0.25, 0, 0)
    with pytest.raises(ValueError, match="out"):
        td.decode_attention(
            torch.zeros(2, 4, 16), kb, kb.clone(), *index, lens, 0.25, out=torch.zeros(2, 4, 8)
        )
    with pytest.raises(ValueError, match="extend_lens"):
        tk.extend_attention(
            torch.zeros(2, 4, 16), kb, kb.clone(), *index, lens, lens.int(), lens, 1, 0.25
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


# ---- the kernels on their own: split counts, GQA groups, tiles ---------------------------
def _reference(s: Setup, batch: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    """The torch backend's attention for `batch`, whose new keys and values are already in
    the pool (it stores them again, unchanged). Returns [num_tokens, heads, head_dim]."""
    k, v = (buf[0][batch.out_cache_loc] for buf in (s.ref_pool.k_buffers, s.ref_pool.v_buffers))
    out = run_backend("torch", s.layout, s.ref_pool, s.table, batch, q.float(), k, v)
    return out.view(q.shape)


def _decode(s: Setup, seq_lens, dtype, **kwargs) -> None:
    """Each request's newest token (already in the pool) through `decode_attention`, with
    the kernel's `kwargs`, against the reference."""
    from lmprog_runtime.attention import triton_decode as td

    batch = _batch(s, [n - 1 for n in seq_lens], [1] * len(seq_lens), mode=ForwardMode.DECODE)
    layout = s.layout
    q = (2 * torch.randn(len(seq_lens), layout.num_heads, layout.head_dim, generator=s.gen)).to(
        dtype
    )
    got = td.decode_attention(
        q,
        s.pool.k_buffers[0],
        s.pool.v_buffers[0],
        s.table.table,
        batch.req_pool_indices,
        torch.tensor(seq_lens),
        layout.scaling,
        layout.sliding_window or 0,
        **kwargs,
    )
    torch.testing.assert_close(got.float(), _reference(s, batch, q), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kv_heads", "page_size"), [(8, 1), (4, 16), (2, 1), (1, 16)]
)  # 8 query heads: groups of 1, 2, 4 and 8
def test_grouped_decode_matches_the_reference(kv_heads, page_size, dtype):
    # 8 splits of 16-key blocks: the 300-key request fills 7 splits of 48 keys, the 1- and
    # 7-key ones fill one split and leave 7 empty. Then the wrapper's own choice.
    seq_lens = [1, 7, 300]
    s = _setup(8, kv_heads, 32, page_size, seq_lens, kv_heads + page_size, dtype=dtype)
    _decode(s, seq_lens, dtype, num_splits=8, block_n=16)
    _decode(s, seq_lens, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_the_reference_for_any_split_count(dtype):
    seq_lens = [3, 64, 65, 250]
    s = _setup(8, 2, 32, 16, seq_lens, 11, dtype=dtype)
    for num_splits in (1, 3, 16):  # 16 blocks of 16 keys: 250 keys fill exactly 16
        _decode(s, seq_lens, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(14, 2, 96), (32, 2, 16), (128, 1, 16)],  # groups of 7, 16 and 128 (two head tiles)
)
def test_decode_with_wide_or_odd_groups_matches_the_reference(heads, kv_heads, head_dim):
    seq_lens = [5, 200]
    s = _setup(heads, kv_heads, head_dim, 4, seq_lens, heads, dtype=torch.bfloat16)
    _decode(s, seq_lens, torch.bfloat16, num_splits=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_splits_start_at_the_sliding_window(dtype):
    # Windows of 40 keys: split 4 ways in blocks of 16, a request of 300 keys reads only
    # keys 260..299; one of 10 reads all it has.
    seq_lens = [10, 41, 300]
    s = _setup(4, 2, 32, 16, seq_lens, 3, window=40, dtype=dtype)
    _decode(s, seq_lens, dtype, num_splits=4, block_n=16)
    _decode(s, seq_lens, dtype)


def test_a_fixed_split_count_serves_any_lengths_and_empty_rows():
    """What a CUDA graph replays: one launch shape (batch, MAX_DECODE_SPLITS) for batches of
    any lengths, padded rows included (no keys: zeros, never NaN)."""
    from lmprog_runtime.attention import triton_decode as td

    for seed, seq_lens in enumerate([[3, 400, 17], [1, 2, 500]]):
        s = _setup(8, 2, 32, 1, seq_lens, seed)
        _decode(s, seq_lens, torch.float32, num_splits=td.MAX_DECODE_SPLITS)
    q = torch.randn(2, 8, 32, generator=s.gen)
    k_buf, v_buf = s.pool.k_buffers[0], s.pool.v_buffers[0]
    out = td.decode_attention(
        q, k_buf, v_buf, s.table.table, torch.tensor(s.rows[:2]), torch.tensor([0, 5]), 0.2, 0, 16
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0


def test_split_count_fills_the_gpu_within_its_bounds():
    from lmprog_runtime.attention.triton_decode import MAX_DECODE_SPLITS, choose_num_splits

    assert choose_num_splits(1, 8, 100) == 1  # too short to split
    assert choose_num_splits(1, 8, 100_000) == MAX_DECODE_SPLITS
    assert choose_num_splits(1, 8, 100_000, max_splits=4) == 4
    assert choose_num_splits(64, 8, 4096) == 1  # 512 programs already fill 132 SMs
    # 64 programs a split: 5 splits fill 2 per SM (264), but leave a second wave a fifth
    # full; 8 fill two waves to 97%.
    assert choose_num_splits(8, 8, 4096) == 8
    assert choose_num_splits(8, 8, 16384) == 8
    assert choose_num_splits(16, 4, 4096) == 8
    assert choose_num_splits(32, 8, 8192) == 2  # 512 programs: the fewest that fill
    assert choose_num_splits(8, 8, 600) == 3  # no split under MIN_SPLIT_LEN keys


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 512), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 1 << 18))
def test_the_split_count_fills_its_waves_past_the_fewest_that_fill_the_gpu(
    batch, kv_heads, seq_len
):
    """Against a search of every count allowed: the fewest splits whose programs reach 2
    per SM (or all the length allows); if their waves are under 90% full, the fewest
    more whose waves are 90% full, or the fullest."""
    from lmprog_runtime.attention.triton_decode import (
        MAX_DECODE_SPLITS,
        MIN_SPLIT_LEN,
        PROGRAMS_PER_SM,
        choose_num_splits,
    )

    places = PROGRAMS_PER_SM * 132  # (the CPU's stand-in SM count)
    allowed = range(1, max(1, min(MAX_DECODE_SPLITS, -(-seq_len // MIN_SPLIT_LEN))) + 1)
    per_split = max(1, batch * kv_heads)
    start = next((s for s in allowed if s * per_split >= places), allowed[-1])

    def filled(s):
        waves = -(-s * per_split // places)
        return s * per_split / (waves * places)

    full_enough = [s for s in allowed if s >= start and filled(s) >= 0.9]
    fullest = max(filled(s) for s in allowed if s >= start)
    want = (
        full_enough[0]
        if full_enough
        else min(s for s in allowed if s >= start and filled(s) == fullest)
    )
    got = choose_num_splits(batch, kv_heads, seq_len)
    assert got == want
    assert 1 <= got <= MAX_DECODE_SPLITS and (got - 1) * MIN_SPLIT_LEN < max(seq_len, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [(16, 16), (32, 64), None])
@pytest.mark.parametrize("window", [None, 24])
def test_extend_with_any_tiles_matches_the_reference(blocks, window, dtype):
    """Queries spread over several row tiles (70 new tokens in tiles of 16 or 32), after
    cached prefixes, with and without a window that drops whole key tiles; None = the
    wrapper's tiles (one of 64 or 128 rows)."""
    from lmprog_runtime.attention import triton_kernels as tk

    prefixes, extends = [0, 37, 5], [70, 20, 1]
    s = _setup(4, 2, 64, 16, [p + e for p, e in zip(prefixes, extends)], 5, window, dtype)
    batch = _batch(s, prefixes, extends)
    q = (2 * torch.randn(batch.num_tokens, 4, 64, generator=s.gen)).to(dtype)
    got = tk.extend_attention(
        q,
        s.pool.k_buffers[0],
        s.pool.v_buffers[0],
        s.table.table,
        batch.req_pool_indices,
        torch.tensor(prefixes),
        torch.tensor(extends),
        torch.tensor([0, 70, 90]),
        max(extends),
        s.layout.scaling,
        window or 0,
        blocks=blocks,
    )
    torch.testing.assert_close(got.float(), _reference(s, batch, q), **TOLERANCE[dtype])
