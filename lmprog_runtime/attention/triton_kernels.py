"""Triton kernels over the paged KV pool: store, extend (prefill) and split-KV decode.

Every kernel finds a request's keys and values through the request-to-token table (slot
indices), so cached prefixes shared through the radix tree are read in place. Each has a
thin wrapper that checks shapes, dtypes and strides before launch. On CPU they run only
under `TRITON_INTERPRET=1` (that is how the tests run them); on CUDA they compile.

Shapes: q [num_tokens, num_heads, head_dim]; k_buf / v_buf [num_slots, num_kv_heads,
head_dim]; req_to_token [num_rows, context_len] int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    q = tl.load(
        q_ptr + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pos = prefix + offs_m  # [BLOCK_M] positions of these queries
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Cached prefix first, then the new tokens up to each query (causal): one walk over
    # positions 0 .. last query, keys read from the pool through the slot table.
    end = prefix + tl.minimum(ext_len, (pid_m + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_off, kv_mask = _kv_block(
            req_to_token, row, stride_r, offs_n, mask_n, kv_h, stride_bt, stride_bh, offs_d, mask_d
        )
        k = tl.load(k_buf + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N]
        allowed = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if window > 0:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_buf + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    part_o,
    part_lse,
    k_buf,
    v_buf,
    req_to_token,
    req_rows,
    seq_lens,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_bh,
    stride_r,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_h = h // GROUP
    seq_len = tl.load(seq_lens + b)
    row = tl.load(req_rows + b)
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    span = seq_len - first
    split_len = (span + NUM_SPLITS - 1) // NUM_SPLITS
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qt + h * stride_qh + offs_d, mask=mask_d, other=0.0).to(
        tl.float32
    )
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        kv_off, kv_mask = _kv_block(
            req_to_token, row, stride_r, offs_n, mask_n, kv_h, stride_bt, stride_bh, offs_d, mask_d
        )
        k = tl.load(k_buf + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, axis=1) * scale
        s = tl.where(mask_n, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_buf + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    # An empty split reports lse = -inf, so stage 2 gives it weight 0.
    lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(part_o + b * stride_pb + h * stride_ph + split * stride_ps + offs_d, out, mask=mask_d)
    tl.store(part_lse + b * stride_lb + h * stride_lh + split, lse)


@triton.jit
def _decode_stage2_kernel(
    part_o,
    part_lse,
    o_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse + b * stride_lb + h * stride_lh + offs_s)
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)  # splits with lse = -inf weigh 0
    o = tl.load(
        part_o + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(
        o_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d
    )


# ---- wrappers ---------------------------------------------------------------------------
def _check(t: torch.Tensor, name: str, dim: int, dtype: torch.dtype | None = None) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension")


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
) -> torch.Tensor:
    """Attention of the new tokens over prefix + themselves (causal). Returns like q."""
    _check(q, "q", 3)
    _check(k_buf, "k_buf", 3)
    _check(req_to_token, "req_to_token", 2, torch.int64)
    for t, name in (
        (req_rows, "req_rows"),
        (prefix_lens, "prefix_lens"),
        (extend_lens, "extend_lens"),
        (extend_starts, "extend_starts"),
    ):
        _check(t, name, 1, torch.int64)
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    if heads % kv_heads or k_buf.shape[2] != head_dim or v_buf.shape != k_buf.shape:
        raise ValueError("extend_attention: head counts or head_dim disagree")
    out = torch.empty_like(q)
    block_m = block_n = 16
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
        scale,
        window,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    num_splits: int = 4,
) -> torch.Tensor:
    """One query per request over its whole sequence: split-KV, then a log-sum-exp merge."""
    _check(q, "q", 3)
    _check(k_buf, "k_buf", 3)
    _check(req_to_token, "req_to_token", 2, torch.int64)
    _check(req_rows, "req_rows", 1, torch.int64)
    _check(seq_lens, "seq_lens", 1, torch.int64)
    if num_splits & (num_splits - 1):
        raise ValueError("num_splits must be a power of two")
    batch, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    if heads % kv_heads or k_buf.shape[2] != head_dim or v_buf.shape != k_buf.shape:
        raise ValueError("decode_attention: head counts or head_dim disagree")
    part_o = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_stage1_kernel[(batch, heads, num_splits)](
        q,
        part_o,
        part_lse,
        k_buf,
        v_buf,
        req_to_token,
        req_rows,
        seq_lens,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        req_to_token.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        scale,
        window,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=16,
        NUM_SPLITS=num_splits,
    )
    out = torch.empty_like(q)
    _decode_stage2_kernel[(batch, heads)](
        part_o,
        part_lse,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
    )
    return out
