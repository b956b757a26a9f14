"""Triton kernels over the paged KV pool: store and extend (prefill), and what the
split-KV decode kernels (`triton_decode.py`) share with them: the key-block walk, the
wrappers' checks and the tiles' dtypes.

Every kernel finds a request's keys and values through the request-to-token table (slot
indices), so cached prefixes shared through the radix tree are read in place. Each has a
thin wrapper that checks shapes, dtypes and strides before launch. On CPU they run only
under `TRITON_INTERPRET=1` (that is how the tests run them); on CUDA they compile.

Extend: one program per (request, query head, block of new tokens) walks the cached prefix
and then its own new tokens (causal, optionally a sliding window), skipping key blocks no
query of the block can see.

Tiles are in the pool's dtype (bfloat16 / float16 operands on tensor cores, float32
accumulation); a float32 pool multiplies in full float32 ("ieee"), not TF32. Under the
interpreter (CPU tensors) every product runs in float32: it cannot multiply bfloat16.
Softmax runs in base 2 (`exp2`), with log2(e) folded into the score scale.

Shapes: q [num_tokens, num_heads, head_dim]; k_buf / v_buf [num_slots, num_kv_heads,
head_dim]; req_to_token [num_rows, context_len] int64.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_buf,
    v_buf,
    loc_ptr,
    stride_kt,
    stride_vt,
    stride_bt,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(
        k_buf + slot * stride_bt + offs, tl.load(k_ptr + t * stride_kt + offs, mask=mask), mask=mask
    )
    tl.store(
        v_buf + slot * stride_bt + offs, tl.load(v_ptr + t * stride_vt + offs, mask=mask), mask=mask
    )


@triton.jit
def _kv_block(
    req_to_token, row, stride_r, offs_n, mask_n, kv_h, stride_bt, stride_bh, offs_d, mask_d
):
    """Offsets into the K/V pool of one block of a request's positions, and their mask:
    [BLOCK_N, BLOCK_D], found through the request's row of slot indices."""
    slots = tl.load(req_to_token + row * stride_r + offs_n, mask=mask_n, other=0)
    kv_off = slots[:, None] * stride_bt + kv_h * stride_bh + offs_d[None, :]
    return kv_off, mask_n[:, None] & mask_d[None, :]


@triton.jit
def _extend_kernel(
    q_ptr,
    o_ptr,
    k_buf,
    v_buf,
    req_to_token,
    req_rows,
    prefix_lens,
    extend_lens,
    extend_starts,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_bh,
    stride_r,
    qk_scale,  # softmax scale * log2(e)
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_m = tl.program_id(2)
    kv_h = h // GROUP
    ext_len = tl.load(extend_lens + b)
    if pid_m * BLOCK_M >= ext_len:
        return
    prefix = tl.load(prefix_lens + b)
    start = tl.load(extend_starts + b)
    row = tl.load(req_rows + b)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext_len
    mask_d = offs_d < HEAD_DIM
    q_off = (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + offs_m  # [BLOCK_M] positions of these queries
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys the block can see: from the window start of its first query to its last query
    # (causal). One walk over the cached prefix, then the new tokens, read from the pool.
    lo = tl.where(window > 0, tl.maximum(prefix + pid_m * BLOCK_M - window + 1, 0), 0)
    hi = prefix + tl.minimum(ext_len, (pid_m + 1) * BLOCK_M)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        kv_off, kv_mask = _kv_block(
            req_to_token, row, stride_r, offs_n, mask_n, kv_h, stride_bt, stride_bh, offs_d, mask_d
        )
        k = tl.load(k_buf + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        allowed = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if window > 0:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row may see no key of this block yet (window, padding rows): keep it at zero.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_buf + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=q_mask)


# ---- wrappers ---------------------------------------------------------------------------
def _check(t: torch.Tensor, name: str, dim: int, dtype: torch.dtype | None = None) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension")


def _check_attention(
    name: str,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    **per_request: torch.Tensor,
) -> None:
    """Checks shared by extend and decode: q and the pool agree, the indices are int64."""
    _check(q, "q", 3)
    _check(k_buf, "k_buf", 3)
    _check(v_buf, "v_buf", 3)
    _check(req_to_token, "req_to_token", 2, torch.int64)
    for key, t in per_request.items():
        _check(t, key, 1, torch.int64)
    if q.shape[1] % k_buf.shape[1] or k_buf.shape[2] != q.shape[2] or v_buf.shape != k_buf.shape:
        raise ValueError(f"{name}: head counts or head_dim disagree")
    if v_buf.stride() != k_buf.stride():
        raise ValueError(f"{name}: k_buf and v_buf must share strides (one offset reads both)")
    if q.dtype not in _DTYPES or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
        raise ValueError(f"{name}: q and the pool must share one of {_DTYPES}, got {q.dtype}")


class _DotConfig(NamedTuple):
    """Constexprs for tl.dot: its operand dtype and float32 precision."""

    DOT_DTYPE: tl.dtype
    PRECISION: str


def _dot_config(t: torch.Tensor) -> _DotConfig:
    # CPU tensors mean the interpreter, whose tl.dot and arithmetic take bfloat16 bit
    # patterns for numbers (triton-lang/triton#11584): it multiplies in float32 instead.
    if t.device.type == "cpu" or t.dtype == torch.float32:
        return _DotConfig(tl.float32, "ieee")  # float32 pools: full precision, not TF32
    # (input_precision concerns float32 operands only; "tf32" is Triton's default.)
    return _DotConfig(tl.float16 if t.dtype == torch.float16 else tl.bfloat16, "tf32")


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must have q's shape and dtype and a unit last stride")
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor
) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] -> k_buf[loc], v_buf[loc]."""
    for t, name in ((k, "k"), (v, "v"), (k_buf, "k_buf"), (v_buf, "v_buf")):
        _check(t, name, 3)
    _check(loc, "loc", 1, torch.int64)
    if k.shape != v.shape or k.shape[1:] != k_buf.shape[1:] or k.shape[0] != loc.shape[0]:
        raise ValueError("store_kv: k, v, the pool and loc disagree in shape")
    if not (k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2] and k_buf.is_contiguous()):
        raise ValueError("store_kv: heads must be contiguous in k, v and the pool")
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_buf,
        v_buf,
        loc,
        k.stride(0),
        v.stride(0),
        k_buf.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


class ExtendTiles(NamedTuple):
    """The extend kernel's tile: BLOCK_M queries by BLOCK_N keys, and its warps."""

    block_m: int
    block_n: int
    num_warps: int


def extend_tiles(head_dim: int, dtype: torch.dtype, capability: tuple[int, int]) -> ExtendTiles:
    """The largest tiles that compile without spilling registers (checked for sm_80 and
    sm_90 by `benchmarks/triton_aot.py` and its test). 16-bit tiles feed tensor cores:
    Hopper's wgmma keeps its accumulator in fewer registers than the mma.sync of sm_80/89,
    so it takes the wider key block at head_dim 128. Float32 multiplies on the FMA units
    (full precision), where a [BLOCK_M, head_dim] accumulator of fp32 must fit beside the
    operands: small tiles.

    Example:
        >>> extend_tiles(128, torch.bfloat16, (9, 0))
        ExtendTiles(block_m=128, block_n=64, num_warps=8)
    """
    if dtype == torch.float32:
        if head_dim <= 64:
            return ExtendTiles(32, 16, 4)
        return ExtendTiles(16, 32, 4) if head_dim <= 128 else ExtendTiles(16, 16, 4)
    if head_dim <= 64 or (head_dim <= 128 and capability[0] == 9):  # wgmma: Hopper
        return ExtendTiles(128, 64, 8)
    return ExtendTiles(128, 32, 8) if head_dim <= 128 else ExtendTiles(64, 32, 8)


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend: int,
    scale: float,
    window: int = 0,
    *,
    out: torch.Tensor | None = None,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention of the new tokens over prefix + themselves (causal); returns `out` (like q).

    Request b's new tokens are rows `extend_starts[b] ..` of q, at positions
    `prefix_lens[b] ..`; its keys are `req_to_token[req_rows[b]]` in the pool, the new
    tokens' already stored. `blocks` (BLOCK_M, BLOCK_N) overrides `extend_tiles`' (tests
    use small tiles), with 8 warps from BLOCK_M 128 and 4 below.

    Example (one request, 5 new tokens after a 3-token prefix):
        >>> out = extend_attention(q, k_buf, v_buf, table, rows, tensor([3]), tensor([5]),
        ...                        tensor([0]), max_extend=5, scale=head_dim**-0.5)  # doctest: +SKIP
    """
    _check_attention(
        "extend_attention",
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_rows=req_rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        extend_starts=extend_starts,
    )
    heads, head_dim = q.shape[1], q.shape[2]
    out = _out(out, q)
    if blocks is None:
        tiles = extend_tiles(head_dim, q.dtype, _capability(q.device))
    else:
        tiles = ExtendTiles(*blocks, num_warps=8 if blocks[0] >= 128 else 4)
    block_m, block_n = tiles.block_m, tiles.block_n
    grid = (req_rows.shape[0], heads, triton.cdiv(max(1, max_extend), block_m))
    _extend_kernel[grid](
        q,
        out,
        k_buf,
        v_buf,
        req_to_token,
        req_rows,
        prefix_lens,
        extend_lens,
        extend_starts,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        req_to_token.stride(0),
        scale * LOG2E,
        window,
        GROUP=heads // k_buf.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=tiles.num_warps,
        **_dot_config(q)._asdict(),
    )
    return out


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (9, 0)  # an H200's: CPU runs (the interpreter) only check the choice
    return torch.cuda.get_device_capability(device)
