"""The native extend (prefill) attention of the native backend (`csrc/extend_attention.cpp`),
bfloat16, on AMX tiles and by AVX512-BF16 dot products, against the torch backend in float32
on the same values.

Every case goes through `NativeAttentionBackend` (which writes the new keys and values to
the pool, then calls the kernel) and through the reference: fresh prompts, cached prefixes,
a sliding window, a mixed extend + decode batch, both head sizes, query-head groups of 1 to
4, prompts of 1 to 300 tokens (whole and partial 16-row blocks and 32-key steps). The
tolerance is the one bfloat16 attention needs anyway: torch's own bfloat16 SDPA on the same
inputs must pass it too (checked in each case), and a broken kernel is far outside it.

Each kernel runs only where it can (AMX compiled in and granted by the OS; AVX512-BF16
compiled in); a CPU with AMX runs both. Elsewhere the backend uses the reference path, which
the other tests cover.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_backend

from lmprog_runtime.attention import AttentionLayout, create_attention_backend, native_backend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
from lmprog_runtime.native import load_native


def _available(amx: bool) -> bool:
    try:
        return bool(load_native().extend_attention_available(amx))
    except RuntimeError:
        return False


KERNELS = [k for k, amx in (("amx", True), ("avx512_bf16", False)) if _available(amx)]
pytestmark = pytest.mark.skipif(not KERNELS, reason="no native extend attention here")


def _setup(heads, kv_heads, head_dim, window, prefixes, extends, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, window)
    total = sum(p + e for p, e in zip(prefixes, extends))
    pool = KVPool(total + 64, 1, kv_heads, head_dim, torch.bfloat16, "cpu")
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = ReqToTokenPool(len(prefixes) + 3, max(p + e for p, e in zip(prefixes, extends)), "cpu")
    slots = torch.randperm(total + 63, generator=gen)[:total] + 1  # shuffled, never slot 0
    rows, offset = [], 0
    for i, (p, e) in enumerate(zip(prefixes, extends)):
        row = len(prefixes) + 2 - i  # rows out of order
        table.write(row, 0, slots[offset : offset + p + e])
        rows.append(row)
        offset += p + e
    num = sum(extends)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(num, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefixes, extends)]),
        out_cache_loc=torch.cat(
            [table.table[r, p : p + e] for r, p, e in zip(rows, prefixes, extends)]
        ),
        req_pool_indices=torch.tensor(rows),
        seq_lens=[p + e for p, e in zip(prefixes, extends)],
        prefix_lens=list(prefixes),
        logits_indices=torch.arange(num),
        num_decodes=sum(1 for e in extends if e == 1),
    )
    q = 2 * torch.randn(num, heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads]  # strided
    k = torch.randn(num, kv_heads, head_dim, generator=gen)
    v = torch.randn(num, kv_heads, head_dim, generator=gen)
    return layout, pool, table, batch, q, k, v


def _run(name, layout, pool, table, batch, q, k, v, dtype):
    p = KVPool(pool.num_slots, 1, layout.num_kv_heads, layout.head_dim, dtype, "cpu")
    p.k_buffers[0].copy_(pool.k_buffers[0])
    p.v_buffers[0].copy_(pool.v_buffers[0])
    return run_backend(name, layout, p, table, batch, q.to(dtype), k.to(dtype), v.to(dtype))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "prefixes", "extends"),
    [
        (9, 3, 64, None, [0, 0], [300, 257]),  # fresh prompts (SmolLM2's heads)
        (4, 4, 64, None, [0, 37, 100, 5], [5, 70, 33, 1]),  # prefixes; a decode-like row
        (8, 2, 128, None, [3, 0], [40, 17]),
        (4, 1, 64, 16, [10, 0, 60], [50, 33, 2]),  # sliding window
        (2, 2, 128, 40, [0], [129]),
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_extend_attention_matches_the_float32_reference(
    heads, kv_heads, head_dim, window, prefixes, extends, kernel, monkeypatch
):
    # The kernel, whatever the mix of new and cached tokens.
    monkeypatch.setattr(native_backend, "NATIVE_EXTEND_MIN_NEW_SHARE", 0.0)
    monkeypatch.setattr(native_backend, "_preferred_extend_kernel", lambda ops: kernel)
    setup = _setup(heads, kv_heads, head_dim, window, prefixes, extends, seed=heads * head_dim)
    layout, pool, table, batch, q, k, v = setup
    ref = _run("torch", *setup, torch.float32)
    got = _run("native", *setup, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    backend = create_attention_backend("native", layout, pool, table)  # the path it took
    backend.init_forward_metadata(batch)
    assert backend._extend_kernel == kernel and backend._native_extend_now
    torch_bf16 = _run("torch", *setup, torch.bfloat16)
    ours, theirs = (got.float() - ref).abs(), (torch_bf16.float() - ref).abs()
    # Within bfloat16's rounding of the output plus its rounding of the weights.
    atol = 2 * 2**-8 * pool.v_buffers[0].abs().max().item()
    tol = atol + 2**-8 * ref.abs()
    assert bool((theirs <= tol).all())  # the tolerance holds for torch's bfloat16 too
    assert bool((ours <= tol).all()), float((ours - tol).max())
    assert float(ours.mean()) <= 2 * float(theirs.mean()) + 1e-4


def test_the_backend_takes_the_native_path_in_bfloat16_unless_new_tokens_are_few():
    layout, pool, table, batch, *_ = _setup(4, 2, 64, None, [0, 10], [20, 30], seed=1)
    bf16 = create_attention_backend("native", layout, pool, table)
    assert bf16._extend_kernel == KERNELS[0]  # AMX where it can run
    bf16.init_forward_metadata(batch)
    assert bf16._native_extend_now  # 50 new tokens of 60 keys
    layout, pool, table, batch, *_ = _setup(4, 2, 64, None, [300, 600], [3, 4], seed=1)
    bf16 = create_attention_backend("native", layout, pool, table)
    bf16.init_forward_metadata(batch)
    assert not bf16._native_extend_now  # 7 of 907: few tokens after long prefixes go to torch
    pool32 = KVPool(pool.num_slots, 1, 2, 64, torch.float32, "cpu")
    assert create_attention_backend("native", layout, pool32, table)._extend_kernel is None
    odd = AttentionLayout(4, 2, 32, 32**-0.5, None)
    pool_odd = KVPool(pool.num_slots, 1, 2, 32, torch.bfloat16, "cpu")
    assert create_attention_backend("native", odd, pool_odd, table)._extend_kernel is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_inputs_are_refused(kernel):
    ops = load_native()
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    buf = torch.zeros(16, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(32).reshape(2, 16) % 16
    one = torch.tensor([0])
    good = (table, torch.tensor([1]), one, torch.tensor([4]), one, 0.125, 0, kernel == "amx")
    ops.extend_attention(q, buf, buf, *good)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.extend_attention(q.float(), buf, buf, *good)
    with pytest.raises(RuntimeError, match="out of range"):  # 4 new tokens, 3 queries
        ops.extend_attention(q[:3], buf, buf, *good)
    bad_table = table.clone()
    bad_table[1, 2] = 99  # a slot past the pool
    with pytest.raises(RuntimeError, match="KV slot"):
        ops.extend_attention(q, buf, buf, bad_table, *good[1:])
