"""Triton split-KV decode attention over the paged KV pool: one query per request.

One program per (request, KV head, split of the keys) computes all the query heads that
share that KV head at once, a `[heads of the group, head_dim]` tile against `[BLOCK_N,
head_dim]` key tiles with `tl.dot`, so each key is read once per group, not once per query
head. Stage 2 merges the splits by their log-sum-exp. The split count comes from the batch's
shape (`choose_num_splits`), or is fixed by the caller (a CUDA graph's, for any lengths).

The tiles, checks and numerics are the extend kernel's (`triton_kernels.py`, whose helpers
this module uses): pool-dtype operands on tensor cores, float32 accumulation, softmax in
base 2. On CPU it runs only under `TRITON_INTERPRET=1`.

Shapes: q [batch, num_heads, head_dim]; k_buf / v_buf [num_slots, num_kv_heads, head_dim];
req_to_token [num_rows, context_len] int64; req_rows, seq_lens [batch] int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lmprog_runtime.attention.triton_kernels import (
    LOG2E,
    _block_d,
    _check_attention,
    _dot_config,
    _kv_block,
    _out,
)

# Decode splits: each split holds at least this many keys, and a batch gets at most
# MAX_DECODE_SPLITS (a CUDA graph passes that fixed count; see `decode_attention`).
MIN_SPLIT_LEN = 256
MAX_DECODE_SPLITS = 16
# Stage-1 programs wanted per streaming multiprocessor (a few waves hide the tail).
PROGRAMS_PER_SM = 2
# The least share of its waves' places a split count's programs should fill: below it a
# few more splits are taken (`choose_num_splits`).
WAVE_FILL = 0.9


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
    qk_scale,  # softmax scale * log2(e)
    window,
    num_splits,  # not a constexpr: each split count would compile a kernel of its own
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_h = tl.program_id(1) // HEAD_BLOCKS
    split = tl.program_id(2)
    # This program's query heads: BLOCK_H of the GROUP heads that share KV head kv_h
    # (rows past the group are padding, masked; tl.dot needs at least 16 rows).
    local = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = local < GROUP
    h = kv_h * GROUP + local  # [BLOCK_H]
    seq_len = tl.load(seq_lens + b)
    row = tl.load(req_rows + b)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Splits are whole blocks of keys, so a short request leaves its last splits empty.
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    hd_mask = mask_h[:, None] & mask_d[None, :]
    q_off = b * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=hd_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_D]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi  # every block holds at least one key, so m_new is finite
        kv_off, kv_mask = _kv_block(
            req_to_token, row, stride_r, offs_n, mask_n, kv_h, stride_bt, stride_bh, offs_d, mask_d
        )
        k = tl.load(k_buf + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_buf + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    # An empty split reports lse = -inf and zeros, so stage 2 gives it weight 0.
    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    p_off = b * stride_pb + h[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
    tl.store(part_o + p_off, out, mask=hd_mask)
    tl.store(part_lse + b * stride_lb + h * stride_lh + split, lse, mask=mask_h)


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
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse_off = b * stride_lb + h * stride_lh + offs_s
    lse = tl.load(part_lse + lse_off, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, axis=0)
    # A request with no keys at all (a padded row of a fixed-size batch) gets zeros.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]; empty splits weigh 0
    o = tl.load(
        part_o + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        o_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d
    )


# ---- wrappers ---------------------------------------------------------------------------
@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's count: CPU runs (the interpreter) only check the choice
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device | str = "cpu",
    max_splits: int = MAX_DECODE_SPLITS,
) -> int:
    """How many splits of the keys a decode batch gets: enough stage-1 programs to fill the
    GPU (`PROGRAMS_PER_SM` a streaming multiprocessor, a "wave"), but no split shorter
    than MIN_SPLIT_LEN keys, and at most `max_splits`. Where the fewest splits that fill
    it leave their last wave less than WAVE_FILL full, the fewest more that fill their
    waves that well (or, if none does, best): that last wave runs as long as a full one.

    Example: 8 requests of 4096 tokens, 8 KV heads, 132 SMs: 5 splits fill the GPU (320
    programs for 264 places), but fill their two waves to 61%; 8 splits (512 programs)
    fill them to 97%, so 8. 64 requests: 1 split, 512 programs, 97% already.
    """
    by_length = triton.cdiv(max_seq_len, MIN_SPLIT_LEN)
    places = PROGRAMS_PER_SM * _num_sms(torch.device(device))
    per_split = max(1, batch_size * num_kv_heads)  # (an empty batch: 1 split)
    most = max(1, min(max_splits, by_length))
    fewest = min(most, triton.cdiv(places, per_split))

    def filled(splits: int) -> float:  # the share of its waves' places the programs use
        programs = splits * per_split
        return programs / (triton.cdiv(programs, places) * places)

    counts = range(fewest, most + 1)
    return next((s for s in counts if filled(s) >= WAVE_FILL), max(counts, key=filled))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """One query per request over its whole sequence: split-KV, then a log-sum-exp merge.

    Returns `out` (like q). The launch grid is `(batch, num_kv_heads * head blocks,
    num_splits)`: it depends on no tensor's values, so with a fixed `num_splits` (e.g.
    MAX_DECODE_SPLITS) the launch can be captured in a CUDA graph and replayed for any
    sequence lengths. Each request cuts its own keys into `num_splits` runs of whole
    BLOCK_N blocks; splits past its end are empty and weigh nothing. `num_splits=None`
    chooses the count with `choose_num_splits`, which reads `seq_lens.max()` (a device
    sync): callers that know the longest length pass the count instead.

    Example (4 requests, a CUDA-graph-friendly fixed split count):
        >>> out = decode_attention(q, k_buf, v_buf, table, rows, seq_lens, head_dim**-0.5,
        ...                        num_splits=MAX_DECODE_SPLITS)  # doctest: +SKIP
    """
    _check_attention(
        "decode_attention", q, k_buf, v_buf, req_to_token, req_rows=req_rows, seq_lens=seq_lens
    )
    batch, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    if num_splits is None:
        max_len = int(seq_lens.max()) if batch else 1
        num_splits = choose_num_splits(batch, kv_heads, max_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    out = _out(out, q)
    if batch == 0:
        return out
    group = heads // kv_heads
    block_h = min(64, max(16, triton.next_power_of_2(group)))
    head_blocks = triton.cdiv(group, block_h)
    if block_n is None:
        # Float32 keys past head_dim 64 spill registers at 32 per block (triton_aot.py).
        block_n = 64 if q.dtype != torch.float32 else 32 if head_dim <= 64 else 16
    block_d = _block_d(head_dim)
    # Per-split partial outputs (normalised) and their log2-sum-exp2, in float32.
    part_o = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_stage1_kernel[(batch, kv_heads * head_blocks, num_splits)](
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
        scale * LOG2E,
        window,
        num_splits,
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        **_dot_config(q)._asdict(),
    )
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
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out
