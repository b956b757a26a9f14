"""Native CPU kernels (csrc/) against the torch reference, and the native engine end to end."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, decode_batch, hf_greedy, hf_greedy_ids, run_backend

from lmprog_runtime.attention import AttentionLayout, create_attention_backend
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
from lmprog_runtime.models.ops import NativeOps, TorchOps


@pytest.fixture(scope="module")
def native_ops():
    return NativeOps()


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fused_ops_match_the_reference(native_ops, rows):
    gen = torch.Generator().manual_seed(rows)
    ref = TorchOps()
    x = torch.randn(rows, 96, generator=gen) * 3
    w = torch.randn(96, generator=gen)
    torch.testing.assert_close(native_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))

    residual = torch.randn(rows, 96, generator=gen)
    expected, expected_res = ref.add_rms_norm(x, residual.clone(), w, 1e-5)
    got, got_res = native_ops.add_rms_norm(x, residual.clone(), w, 1e-5)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_res, expected_res)

    gate_up = torch.randn(rows, 2 * 40, generator=gen) * 4
    torch.testing.assert_close(native_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))

    # RoPE on strided views into a fused qkv projection, as the model calls it.
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
    angles = torch.rand(50, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.randint(0, 50, (rows,), generator=gen)
    expected_q, expected_k = ref.rope(q.clone(), k.clone(), positions, cos, sin)
    got_q, got_k = native_ops.rope(q, k, positions, cos, sin)
    torch.testing.assert_close(got_q, expected_q)
    torch.testing.assert_close(got_k, expected_k)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window"),
    [
        (4, 4, 16, None),
        (4, 2, 32, None),
        (8, 2, 64, None),
        (4, 1, 16, 5),
    ],
)
def test_native_decode_attention_matches_torch(heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(heads * head_dim)
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, window)
    num_slots, seq_lens = 200, [1, 9, 33, 17]
    pool = KVPool(num_slots, 1, kv_heads, head_dim, torch.float32, "cpu")
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = ReqToTokenPool(6, 64, "cpu")
    # Non-contiguous, shuffled slots per request; rows out of order.
    slots = torch.randperm(num_slots, generator=gen)[: sum(seq_lens)] + 1
    rows, offset = [4, 0, 2, 5], 0
    for row, n in zip(rows, seq_lens):
        table.write(row, 0, slots[offset : offset + n])
        offset += n
    batch = decode_batch(table, rows, seq_lens)
    q = torch.randn(4, heads, head_dim, generator=gen)
    k = torch.randn(4, kv_heads, head_dim, generator=gen)
    v = torch.randn(4, kv_heads, head_dim, generator=gen)
    ref = run_backend("torch", layout, pool, table, batch, q, k, v)
    got = run_backend("native", layout, pool, table, batch, q, k, v)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_native_and_torch_engines_agree_with_transformers(tiny_path, hf_tiny):
    from lmprog_runtime import Engine

    results = {}
    for name in ("torch", "native"):
        with Engine(tiny_path, attention_backend=name, max_total_tokens=4096) as engine:
            assert engine.runner.attention_backend == name
            outs = engine.generate(PROMPTS, {"max_new_tokens": 16, "temperature": 0})
            results[name] = [o["output_ids"] for o in outs]
    assert results["torch"] == results["native"]
    assert results["native"] == [hf_greedy(hf_tiny, p, 16) for p in PROMPTS]


def test_default_backend_on_cpu_is_native(engine):
    assert engine.runner.attention_backend == "native"


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_cascade_decode_over_a_shared_prefix_matches_torch(heads, kv_heads):
    """Three requests share a 100-slot prefix (as after a fork), two do not: the native
    backend attends the shared prefix once per group and merges by log-sum-exp."""
    gen = torch.Generator().manual_seed(heads)
    head_dim = 16
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, None)
    pool = KVPool(600, 1, kv_heads, head_dim, torch.float32, "cpu")
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = ReqToTokenPool(6, 256, "cpu")
    slots = (torch.randperm(599, generator=gen) + 1).tolist()
    shared, rest = slots[:100], slots[100:]
    seq_lens, rows = [107, 112, 101, 30, 75], [5, 2, 0, 1, 4]
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        own = [rest.pop() for _ in range(n - (100 if i < 3 else 0))]
        table.write(row, 0, torch.tensor((shared if i < 3 else []) + own))
    batch = decode_batch(table, rows, seq_lens)
    q = torch.randn(5, heads, head_dim, generator=gen)
    k = torch.randn(5, kv_heads, head_dim, generator=gen)
    v = torch.randn(5, kv_heads, head_dim, generator=gen)
    outs = {}
    for name in ("torch", "native"):
        backend = create_attention_backend(name, layout, pool, table)
        backend.init_forward_metadata(batch)
        outs[name] = backend.forward(q, k, v, 0, batch)
        if name == "native":
            assert len(backend._groups) == 1 and backend._groups[0].slots.numel() == 100
    torch.testing.assert_close(outs["native"], outs["torch"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (8, 2, None), (8, 2, 40)])
def test_cascade_decode_with_several_prefix_groups_matches_torch(heads, kv_heads, window):
    """Ten requests in one decode batch, rows and batch order shuffled:
    - group A: three requests on a 100-slot prefix in consecutive slots (as one prefill
      allocates them); one of them has a single key of its own;
    - group B, nested: three requests on an 80-slot prefix in scattered slots, two of which
      share 50 more slots after it, so the group's common prefix is the 80 only;
    - two requests that share only 30 slots (too short for a group), and two with nothing
      shared.
    The native backend must form exactly groups A and B (no group with a sliding window,
    where a shared prefix is not attended to in full) and match the torch reference."""
    gen = torch.Generator().manual_seed(heads + (window or 0))
    head_dim = 16
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, window)
    pool = KVPool(1200, 1, kv_heads, head_dim, torch.float32, "cpu")
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    free = (torch.randperm(1200 - 100, generator=gen) + 101).tolist()  # 1..100 are A's

    def take(n: int) -> list[int]:
        return [free.pop() for _ in range(n)]

    prefix_a, prefix_b, extra_b, short = list(range(1, 101)), take(80), take(50), take(30)
    sequences = {
        "a1": prefix_a + take(7),
        "a2": prefix_a + take(12),
        "a3": prefix_a + take(1),
        "b1": prefix_b + extra_b + take(5),
        "b2": prefix_b + extra_b + take(9),
        "b3": prefix_b + take(20),
        "c1": short + take(40),
        "c2": short + take(45),
        "d1": take(40),
        "d2": take(90),
    }
    names = ["b1", "d1", "a1", "c1", "b2", "a3", "d2", "a2", "c2", "b3"]
    rows = torch.randperm(12, generator=gen)[: len(names)].tolist()
    table = ReqToTokenPool(12, 256, "cpu")
    for row, name in zip(rows, names):
        table.write(row, 0, torch.tensor(sequences[name]))
    batch = decode_batch(table, rows, [len(sequences[n]) for n in names])
    q = torch.randn(len(names), heads, head_dim, generator=gen)
    k = torch.randn(len(names), kv_heads, head_dim, generator=gen)
    v = torch.randn(len(names), kv_heads, head_dim, generator=gen)

    ref = run_backend("torch", layout, pool, table, batch, q, k, v)
    native = create_attention_backend("native", layout, pool, table)
    native.init_forward_metadata(batch)
    got = native.forward(q, k, v, 0, batch)
    groups = {
        frozenset(names[i] for i in g.members.tolist()): (g.slots.tolist(), g.span is not None)
        for g in native._groups
    }
    if window is None:
        assert groups == {
            frozenset({"a1", "a2", "a3"}): (prefix_a, True),
            frozenset({"b1", "b2", "b3"}): (prefix_b, False),
        }
    else:
        assert groups == {}
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_native_engine_decodes_two_prefix_groups_by_cascade_as_transformers(tiny_path, hf_tiny):
    """Two groups of prompts, each sharing a different system prompt of 100 / 80 tokens, and
    two prompts of their own, in one `generate`: the engine's decode steps form two prefix
    groups over the radix cache's shared slots, and greedy tokens equal transformers'."""
    from lmprog_runtime import Engine

    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=gen).tolist()

    system_a, system_b = ids(100), ids(80)
    prompts = [system_a + ids(3 + i) for i in range(3)] + [system_b + ids(4 + i) for i in range(3)]
    prompts += [ids(20), ids(70)]
    expected = hf_greedy_ids(hf_tiny[0], prompts, 8)

    num_groups: list[int] = []
    with Engine(tiny_path, attention_backend="native", max_total_tokens=4096) as engine:
        backend = engine.runner.attention
        init = backend.init_forward_metadata

        def spy(batch):
            init(batch)
            if batch.mode.name == "DECODE":
                num_groups.append(len(backend._groups))

        backend.init_forward_metadata = spy
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0}
        )
    assert [o["output_ids"] for o in outs] == expected
    assert max(num_groups) == 2
