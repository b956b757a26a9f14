"""The forward's elementwise ops as fused Triton kernels: one memory pass and one launch
each, where `TorchOps` launches five to ten small kernels (the GPU set; `NativeOps` is the
CPU one).

Same interface and numerics as `TorchOps`, float32 arithmetic inside: RMSNorm rounds the
normalised row to the activations' dtype before the weight, as the reference does;
SiLU-and-mul rounds the SiLU first, as `F.silu(gate) * up` does; RoPE reads its position's
cos/sin row in the kernel (no gathered, cast copy per layer) and rounds once, where the
reference rounds every product. Like `NativeOps`, `add_rms_norm` leaves the sum in
`residual` and `rope` rotates q and k in place.

Imported only when the runner picks it (the Triton backend on CUDA): `import lmprog` never
imports Triton. On CPU tensors the kernels run only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmprog_runtime.models.ops import TorchOps


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(residual.dtype)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = weight * normed
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + dim + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    out = silu * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(up.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_stride_token,
    q_stride_head,
    k_stride_token,
    k_stride_head,
    table_stride,
    num_q_heads,
    half,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        ptr = q_ptr + token * q_stride_token + head * q_stride_head
    else:
        ptr = k_ptr + token * k_stride_token + (head - num_q_heads) * k_stride_head
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    table_row = tl.load(positions_ptr + token) * table_stride
    cos1 = tl.load(cos_ptr + table_row + cols, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table_row + cols, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(ptr + cols, mask=mask, other=0.0)
    x2 = tl.load(ptr + half + cols, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin
    tl.store(ptr + cols, (a * cos1 - b * sin1).to(x1.dtype), mask=mask)
    tl.store(ptr + half + cols, (b * cos2 + a * sin2).to(x1.dtype), mask=mask)


class TritonOps(TorchOps):
    """Fused Triton kernels over CUDA tensors (float32, float16 or bfloat16)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x, "x")
        _check_vector(weight, rows.shape[1], "weight")
        out = torch.empty(
            rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
        )
        _launch_rms_norm(rows, None, weight, out, eps)
        return out.view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(residual + x), residual + x); the sum is written into
        `residual` (2-D [num_tokens, hidden], last dimension contiguous)."""
        rows = _rows(x, "x")
        if residual.shape != rows.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError("add_rms_norm: residual must be like x, its rows contiguous")
        _check_vector(weight, rows.shape[1], "weight")
        out = torch.empty(
            rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
        )
        _launch_rms_norm(rows, residual, weight, out, eps)
        return out, residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, "x")
        if rows.shape[1] % 2:
            raise ValueError("silu_and_mul: the last dimension must be even ([gate, up])")
        dim = rows.shape[1] // 2
        out = torch.empty((rows.shape[0], dim), dtype=x.dtype, device=x.device)
        block = min(1024, triton.next_power_of_2(dim))
        grid = (rows.shape[0], triton.cdiv(dim, block))
        if rows.shape[0]:
            _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), dim, BLOCK=block)
        return out.view(*x.shape[:-1], dim)

    @staticmethod
    def rope(
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim] in
        place (any token and head strides, head_dim contiguous); cos/sin: [context_len,
        head_dim] tables, row `positions[t]` for token t."""
        if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
        num_tokens, num_q_heads, head_dim = q.shape
        if head_dim % 2 or q.stride(2) != 1 or k.stride(2) != 1:
            raise ValueError("rope: head_dim must be even and contiguous")
        if positions.shape != (num_tokens,) or positions.dtype != torch.int64:
            raise ValueError("rope: positions must be [num_tokens] int64")
        positions = positions.contiguous()  # (the kernel reads token t's at offset t)
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
            raise ValueError("rope: cos and sin must be [context_len, head_dim]")
        if cos.stride() != sin.stride() or cos.stride(1) != 1:
            raise ValueError("rope: cos and sin rows must be contiguous, with equal strides")
        if k.dtype != q.dtype:
            raise ValueError(f"rope: q is {q.dtype} and k {k.dtype}")
        for t in (k, positions, cos, sin):
            if t.device != q.device:
                raise ValueError(f"rope: tensors on {q.device} and {t.device}")
        if num_tokens:
            half = head_dim // 2
            _rope_kernel[(num_tokens, num_q_heads + k.shape[1])](
                q,
                k,
                positions,
                cos,
                sin,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                cos.stride(0),
                num_q_heads,
                half,
                BLOCK=triton.next_power_of_2(half),
            )
        return q, k


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as 2-D rows [n, last dim] with a contiguous last dimension (a view when it can)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _check_vector(weight: torch.Tensor, dim: int, name: str) -> None:
    if weight.shape != (dim,) or weight.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous [{dim}] vector, got {tuple(weight.shape)}")


def _launch_rms_norm(
    rows: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    for t in (residual, weight, out):
        if t is not None and t.device != rows.device:
            raise ValueError(f"rms_norm: tensors on {rows.device} and {t.device}")
    if not rows.shape[0]:
        return
    dim = rows.shape[1]
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual if residual is not None else rows,
        weight,
        out,
        rows.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),  # a whole row per program
    )
