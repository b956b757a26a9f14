"""Native CPU kernels (csrc/) against the torch reference, and the native engine end to end.

float32 kernels are held to the reference at float32 precision. bfloat16 kernels are held to
the reference computed in float32 on the same bfloat16 inputs, within the roundings to
bfloat16 the kernel makes: one rounding to nearest errs by at most BF16_EPS relative, so a
kernel that computes in float32 and rounds once at its store (SiLU-and-mul, RoPE, decode
attention) stays within rtol=BF16_EPS; RMSNorm rounds twice as the reference does (the
normalized row, then its product with the weight). The atol of 1e-5 covers the float32
noise of summation order on values of order one; any real error (a wrong index, a lost term,
bfloat16 accumulation) is far larger.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, decode_batch, hf_greedy, hf_greedy_ids, run_backend

from lmprog_runtime.attention import AttentionLayout, create_attention_backend
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
from lmprog_runtime.models.ops import NativeOps, TorchOps

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: unit roundoff 2^-8
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def native_ops():
    return NativeOps()


def assert_kernel_close(got: torch.Tensor, expected: torch.Tensor, roundings: int = 1) -> None:
    """`got` from a kernel in float32 or bfloat16; `expected` from the float32 reference on the
    same inputs. bfloat16: within `roundings` roundings to bfloat16 (see the module doc)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    assert got.dtype == torch.bfloat16
    rtol = (1 + BF16_EPS) ** roundings - 1
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
# 2048 rows: past the size from which the ops split their rows among threads.
@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
def test_fused_ops_match_the_reference(native_ops, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    ref = TorchOps()
    x = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    expected = ref.rms_norm(x.float(), w.float(), 1e-6)
    assert_kernel_close(native_ops.rms_norm(x, w, 1e-6), expected, roundings=2)

    # The residual stream stays in the input dtype: residual + x, rounded once.
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    expected_res = (residual.float() + x.float()).to(dtype)
    got, got_res = native_ops.add_rms_norm(x, residual.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, expected_res, rtol=0, atol=0)
    expected = ref.rms_norm(expected_res.float(), w.float(), 1e-5)
    assert_kernel_close(got, expected, roundings=2)

    gate_up = (torch.randn(rows, 2 * 40, generator=gen) * 4).to(dtype)
    assert_kernel_close(native_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up.float()))
    # Gates far below zero, where e^-g overflows float32 (from -88.7): silu is -0 there, and
    # the build's -ffast-math once turned g / (1 + inf) into NaN.
    gate_up[:, :8] = torch.linspace(-300, -80, 8).to(dtype)
    assert_kernel_close(native_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up.float()))

    # RoPE on strided views into a fused qkv projection, as the model calls it; the tables
    # are float32, or the model's dtype (a bfloat16 model casts its buffers).
    heads, kv_heads, dim = 4, 2, 16
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(dtype)

    def q_k_views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(rows, heads, dim), k.view(rows, kv_heads, dim)

    angles = torch.rand(50, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.randint(0, 50, (rows,), generator=gen)
    for table_dtype in {torch.float32, dtype}:
        c, s = cos.to(table_dtype), sin.to(table_dtype)
        q, k = q_k_views(qkv.float())
        expected_q, expected_k = ref.rope(q, k, positions, c.float(), s.float())
        q, k = q_k_views(qkv.clone())
        got_q, got_k = native_ops.rope(q, k, positions, c, s)
        assert_kernel_close(got_q, expected_q)
        assert_kernel_close(got_k, expected_k)


def test_native_kernels_refuse_other_dtypes(native_ops):
    x = torch.randn(3, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native_ops.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="weight has dtype"):
        native_ops.rms_norm(x.bfloat16(), torch.ones(8), 1e-6)


def _float32_reference(layout, pool, table, batch, q, k, v) -> torch.Tensor:
    """The torch backend in float32 on the same values as `pool` and q/k/v."""
    pool32 = KVPool(pool.num_slots, 1, layout.num_kv_heads, layout.head_dim, torch.float32, "cpu")
    pool32.k_buffers[0].copy_(pool.k_buffers[0])
    pool32.v_buffers[0].copy_(pool.v_buffers[0])
    return run_backend("torch", layout, pool32, table, batch, q.float(), k.float(), v.float())


def assert_cascade_close(got: torch.Tensor, expected: torch.Tensor, pool: KVPool) -> None:
    """Decode attention that rounds its softmax weights to bfloat16, against the float32
    reference. Rounding the weights moves the output by at most BF16_EPS * max|v|. Cascade
    decode: the prefix pass (torch's fused attention kernel) and the suffix pass (the native
    kernel) may each round their weights, and round their outputs, so the merged row is
    within 2 * BF16_EPS * max|v| before its own final rounding."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    atol = 2 * BF16_EPS * pool.v_buffers[0].abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=BF16_EPS, atol=atol)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window"),
    [
        (4, 4, 16, None),
        (4, 2, 32, None),
        (8, 2, 64, None),
        (10, 2, 64, None),
        (6, 2, 128, None),
        (4, 1, 16, 5),
        (4, 1, 64, 5),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_attention_matches_torch(heads, kv_heads, head_dim, window, dtype):
    gen = torch.Generator().manual_seed(heads * head_dim)
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, window)
    num_slots, seq_lens = 200, [1, 9, 33, 17]
    pool = KVPool(num_slots, 1, kv_heads, head_dim, dtype, "cpu")
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
    q = (torch.randn(4, heads, head_dim, generator=gen) * 2).to(dtype)
    k = torch.randn(4, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(4, kv_heads, head_dim, generator=gen).to(dtype)
    got = run_backend("native", layout, pool, table, batch, q, k, v)
    expected = _float32_reference(layout, pool, table, batch, q, k, v)
    if dtype == torch.bfloat16 and head_dim % 64 == 0:
        # bfloat16 value products (head sizes a multiple of 64): the probabilities are
        # rounded to bfloat16 first, as in transformers' bfloat16 attention.
        assert_cascade_close(got, expected, pool)
    else:
        assert_kernel_close(got, expected)


@pytest.mark.parametrize(
    ("rows", "order", "message"),
    [
        ([0, 1_000_000], [0, 1], "req_rows out of range"),  # (read past the table: SIGSEGV)
        ([0, -1], [0, 1], "req_rows out of range"),
        ([0, 1], [0, 0], "permutation"),  # (a request's output was left unwritten)
    ],
)
def test_decode_attention_refuses_rows_and_orders_out_of_range(rows, order, message):
    from lmprog_runtime.native import load_native

    q = torch.randn(2, 4, 16)
    k_buf = v_buf = torch.randn(40, 2, 16)
    table = torch.arange(1, 3 * 8 + 1).view(3, 8)  # rows 0-2 of 8 slots
    args = [torch.tensor(rows), torch.tensor([3, 5]), torch.zeros(2, dtype=torch.int64)]
    with pytest.raises(RuntimeError, match=message):
        load_native().decode_attention(q, k_buf, v_buf, table, *args, torch.tensor(order), 0.25, 0)


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


@pytest.fixture
def always_cascade(monkeypatch):
    """Cascade attention for any shared prefix of 64+ tokens: these tests' prefixes are far
    shorter than the ones it pays for (`CASCADE_MIN_SPARED_KEYS`)."""
    from lmprog_runtime.attention import native_backend

    monkeypatch.setattr(native_backend, "CASCADE_MIN_SPARED_KEYS", 0)


def test_default_backend_on_cpu_is_native(engine):
    assert engine.runner.attention_backend == "native"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_cascade_decode_over_a_shared_prefix_matches_torch(heads, kv_heads, dtype, always_cascade):
    """Three requests share a 100-slot prefix (as after a fork), two do not: the native
    backend attends the shared prefix once per group and merges by log-sum-exp."""
    gen = torch.Generator().manual_seed(heads)
    head_dim = 16
    layout = AttentionLayout(heads, kv_heads, head_dim, head_dim**-0.5, None)
    pool = KVPool(600, 1, kv_heads, head_dim, dtype, "cpu")
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
    q = (torch.randn(5, heads, head_dim, generator=gen) * 2).to(dtype)
    k = torch.randn(5, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(5, kv_heads, head_dim, generator=gen).to(dtype)
    native = create_attention_backend("native", layout, pool, table)
    native.init_forward_metadata(batch)
    got = native.forward(q, k, v, 0, batch)
    assert len(native._groups) == 1 and native._groups[0].slots.numel() == 100
    assert_cascade_close(got, _float32_reference(layout, pool, table, batch, q, k, v), pool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (8, 2, None), (8, 2, 40)])
def test_cascade_decode_with_several_prefix_groups_matches_torch(
    heads, kv_heads, window, dtype, always_cascade
):
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
    pool = KVPool(1200, 1, kv_heads, head_dim, dtype, "cpu")
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
    q = (torch.randn(len(names), heads, head_dim, generator=gen) * 2).to(dtype)
    k = torch.randn(len(names), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(names), kv_heads, head_dim, generator=gen).to(dtype)

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
    assert_cascade_close(got, _float32_reference(layout, pool, table, batch, q, k, v), pool)


def test_native_engine_decodes_two_prefix_groups_by_cascade_as_transformers(
    tiny_path, hf_tiny, always_cascade
):
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


def _greedy_with_logits(engine, prompts: list[list[int]], max_new_tokens: int):
    """Greedy tokens of each prompt, and the next-token logits of each of its steps
    ([max_new_tokens, vocab], recorded from the runner). Returns them and the largest
    number of prefix groups a decode step formed (native backend; 0 otherwise)."""
    steps: dict[tuple[int, ...], list[torch.Tensor]] = {}
    num_groups = [0]
    forward = engine.runner.forward

    def recording_forward(batch):
        logits, rows = forward(batch)
        for req, mine in zip(batch.reqs, rows):
            steps.setdefault(tuple(req.input_ids), []).append(logits[mine[-1]].clone())
        if batch.mode.name == "DECODE":
            groups = getattr(engine.runner.attention, "_groups", [])
            num_groups[0] = max(num_groups[0], len(groups))
        return logits, rows

    engine.runner.forward = recording_forward
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    logits = [torch.stack(steps[tuple(p)]) for p in prompts]
    return [o["output_ids"] for o in outs], logits, num_groups[0]


def test_native_engine_in_bfloat16_matches_the_torch_backend(tiny_path, always_cascade):
    """bfloat16 end to end: the native kernels (norms, SiLU, RoPE, decode attention, cascade
    over two shared system prompts) against the torch backend, both in bfloat16.

    Logits are compared on every step where both runs have generated the same tokens so far
    (each prompt up to and including its first differing token): max |native - torch| within
    5% of max |torch|. bfloat16 itself moves this model's logits by about 3% of their range
    (the torch backend in bfloat16 against float32; native in bfloat16 against float32
    likewise), so two bfloat16 paths that round differently differ by as much; a broken
    kernel moves them by far more. Greedy tokens then split only at near ties (bfloat16
    logits of this random model tie often): at least half of all positions must precede
    each prompt's first differing token (measured: 74%)."""
    from lmprog_runtime import Engine
    from lmprog_runtime.models.ops import NativeOps

    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=gen).tolist()

    system_a, system_b = ids(100), ids(80)
    prompts = [system_a + ids(3 + i) for i in range(3)] + [system_b + ids(4 + i) for i in range(3)]
    prompts += [ids(20), ids(70), ids(5), ids(200)]
    runs = {}
    for name in ("auto", "torch"):
        with Engine(
            tiny_path, dtype="bfloat16", attention_backend=name, max_total_tokens=4096
        ) as e:
            assert e.runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
            runs[name] = _greedy_with_logits(e, prompts, 24)
            if name == "auto":  # bfloat16 on CPU resolves to the native kernels
                assert e.runner.attention_backend == "native"
                assert isinstance(e.runner.model.ops, NativeOps)
    (native_ids, native_logits, num_groups), (torch_ids, torch_logits, _) = runs.values()
    assert num_groups == 2
    agreed = 0
    for mine, theirs, mine_logits, their_logits in zip(
        native_ids, torch_ids, native_logits, torch_logits
    ):
        first_diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        agreed += len(mine) if first_diff is None else first_diff
        same_context = len(mine) if first_diff is None else first_diff + 1
        for got, ref in zip(mine_logits[:same_context], their_logits[:same_context]):
            assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert agreed >= 0.5 * sum(len(t) for t in torch_ids)


def test_the_build_key_covers_the_cpu_and_the_torch_it_links(tmp_path, monkeypatch):
    """A cache shared between machines keeps one build per CPU and torch: a build for a CPU
    with AMX must never load on one without it."""
    import torch as torch_module

    from lmprog_runtime import native

    source = tmp_path / "kernel.cpp"
    source.write_text("int f();")
    key = native.build_key([source])
    assert key == native.build_key([source])
    monkeypatch.setattr(native, "cpu_flags", lambda: b"avx2 avx512f")
    without_amx = native.build_key([source])
    monkeypatch.setattr(native, "cpu_flags", lambda: b"amx_bf16 amx_tile avx2 avx512f")
    assert native.build_key([source]) != without_amx
    monkeypatch.setattr(torch_module, "__version__", "0.0.0")
    assert native.build_key([source]) not in (key, without_amx)
    source.write_text("int g();")
    monkeypatch.undo()
    assert native.build_key([source]) != key
    if Path("/proc/cpuinfo").is_file():  # Linux: this machine's flags, as the kernel lists them
        flags = native.cpu_flags().split()
        assert flags and flags == sorted(flags)
