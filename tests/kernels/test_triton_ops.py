"""The fused Triton ops (RMSNorm, add+RMSNorm, SiLU-and-mul, RoPE) against `TorchOps`.

CPU tensors under `TRITON_INTERPRET=1` (set by conftest.py): the kernels' arithmetic,
masking of odd sizes and strided inputs are checked here; speed is the GPU check's
business (`benchmarks/gpu_check.py`).
"""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime.models.ops import TorchOps
from lmprog_runtime.models.triton_ops import TritonOps

# float32: equal up to summation order; bfloat16: a rounding or two apart (the interpreter
# also rounds float32 -> bfloat16 toward zero, GPUs to nearest).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cpu").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 80, 200])
def test_rms_norm(dtype, dim):
    x = _randn(5, dim, dtype=dtype) * 3
    weight = _randn(dim, dtype=dtype, seed=1)
    got = TritonOps.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, TorchOps.rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_writes_the_sum_into_residual(dtype):
    x, residual = _randn(7, 96, dtype=dtype), _randn(7, 96, dtype=dtype, seed=1)
    weight = _randn(96, dtype=dtype, seed=2)
    want_out, want_sum = TorchOps().add_rms_norm(x, residual.clone(), weight, 1e-5)
    got_out, got_sum = TritonOps().add_rms_norm(x, residual, weight, 1e-5)
    assert got_sum is residual
    # One rounding, as torch; the interpreter rounds float32 -> bfloat16 toward zero where
    # GPUs round to nearest, so in bfloat16 the sum may be one unit in the last place off.
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(got_sum, want_sum, **exact)
    torch.testing.assert_close(got_out, want_out, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [48, 176])
def test_silu_and_mul(dtype, dim):
    x = _randn(6, 2 * dim, dtype=dtype) * 4
    got = TritonOps.silu_and_mul(x)
    torch.testing.assert_close(got, TorchOps.silu_and_mul(x), **TOLERANCE[dtype])
    # rows whose leading dimensions cannot merge: the launch read `x` with the strides of
    # its reshaped copy
    x3 = _randn(4, 3, 2 * dim, dtype=dtype)[:, :2]
    got = TritonOps.silu_and_mul(x3)
    torch.testing.assert_close(got, TorchOps.silu_and_mul(x3), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 40])
@pytest.mark.parametrize("strided_positions", [False, True])
def test_rope_in_place_on_views_of_a_fused_projection(dtype, head_dim, strided_positions):
    """q and k are strided views into one [tokens, (heads + 2 * kv_heads) * head_dim]
    projection, as in the model; v (the rest) must not change. Positions may be a strided
    view too (the kernel once read a slice's positions as if contiguous)."""
    num_tokens, heads, kv_heads, context_len = 9, 4, 2, 64
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    positions = torch.tensor([0, 3, 63, 5, 5, 1, 17, 40, 2], dtype=torch.int64, device="cpu")
    if strided_positions:
        positions = torch.stack([positions, positions.flip(0)], dim=1)[:, 0]
    freqs = torch.arange(context_len, device="cpu")[:, None] * (
        10000.0 ** (-torch.arange(0, head_dim, 2, device="cpu") / head_dim)
    )
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(num_tokens, heads, head_dim),
            k.view(num_tokens, kv_heads, head_dim),
            v.view(num_tokens, kv_heads, head_dim),
        )

    want_q, want_k = TorchOps.rope(*views(qkv)[:2], positions, cos, sin)
    ours = qkv.clone()
    q, k, v = views(ours)
    got_q, got_k = TritonOps.rope(q, k, positions, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, want_k, **TOLERANCE[dtype])
    torch.testing.assert_close(v, views(qkv)[2], atol=0, rtol=0)


def test_bad_shapes_are_refused_before_launch():
    x = _randn(4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight"):
        TritonOps.rms_norm(x, _randn(32, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="even"):
        TritonOps.silu_and_mul(_randn(4, 63, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        TritonOps.rms_norm(x.t(), _randn(4, dtype=torch.float32), 1e-6)
    positions = torch.zeros(4, dtype=torch.int64, device="cpu")
    table = _randn(8, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="disagree"):
        TritonOps.rope(
            _randn(4, 2, 16, dtype=torch.float32),
            _randn(3, 2, 16, dtype=torch.float32),
            positions,
            table,
            table,
        )
