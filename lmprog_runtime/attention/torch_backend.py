"""The reference attention backend: gather each request's K/V from the pool, then SDPA.

Correct for any mix of cached prefixes, new tokens and lengths; other backends are tested
against this one.

- Decode: gather `[batch, kv_heads, max_len, dim]` through the request-to-token table; the
  query heads that share a KV head are folded into the query axis, so K/V are never copied
  per query head.
- Extend: requests are bucketed by their number of new tokens (so one long chunk does not
  pad a hundred short suffixes to its length), and each bucket runs one SDPA with
  grouped-query heads. A bucket with no cached prefix attends over its own new k/v (no pool
  gather); otherwise keys come from the pool with a mask shifted by each prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmprog_runtime.attention.base import BaseAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.transfer import index_tensor, to_device

# A bucket holds requests whose new-token counts are within this factor of its shortest.
BUCKET_GROWTH = 2
BUCKET_SLACK = 16


@dataclass
class _Bucket:
    num_reqs: int
    max_q: int
    max_len: int
    src_rows: torch.Tensor | None  # rows of the flat batch; None = all rows, in order
    dst_rows: torch.Tensor | None  # their rows in the padded [num_reqs * max_q] layout
    kv_index: torch.Tensor | None  # [num_reqs * max_len] pool slots; None = fresh (new k/v)
    mask: torch.Tensor | None  # additive [num_reqs, 1, max_q, keys]; None = plain causal


class TorchAttentionBackend(BaseAttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            self._init_decode(batch)
        else:
            self._buckets = self._init_extend(batch)

    # ---- decode -------------------------------------------------------------------------
    def _init_decode(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        window = self.layout.sliding_window
        max_len = max(batch.seq_lens)
        self._max_len = max_len
        self._kv_index = self.req_to_token.table[batch.req_pool_indices, :max_len].reshape(-1)
        if min(batch.seq_lens) == max_len and (window is None or window >= max_len):
            self._mask = None
            return
        key_pos = torch.arange(max_len, device=device)
        q_pos = index_tensor(batch.seq_lens, device)[:, None] - 1  # [batch, 1]
        mask = key_pos[None, :] <= q_pos
        if window is not None:
            mask &= key_pos[None, :] > q_pos - window
        self._mask = mask[:, None, None, :]  # [batch, 1, 1, max_len]

    def _forward_decode(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        layout = self.layout
        bsz, max_len = batch.batch_size, self._max_len
        kv_heads, head_dim = layout.num_kv_heads, layout.head_dim
        group = layout.num_heads // kv_heads
        keys, values = self._gather(layer_id, self._kv_index, bsz, max_len)
        q = q.reshape(bsz, kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=self._mask, scale=layout.scaling
        )
        return out.reshape(bsz, layout.num_heads * head_dim)

    # ---- extend -------------------------------------------------------------------------
    def _init_extend(self, batch: ForwardBatch) -> list[_Bucket]:
        extend_lens = batch.extend_lens
        order = sorted(range(batch.batch_size), key=lambda i: extend_lens[i])
        groups: list[list[int]] = []
        for i in order:
            if (
                not groups
                or extend_lens[i] > BUCKET_GROWTH * extend_lens[groups[-1][0]] + BUCKET_SLACK
            ):
                groups.append([])
            groups[-1].append(i)
        starts = [0]
        for n in extend_lens:
            starts.append(starts[-1] + n)
        return [self._make_bucket(batch, sorted(g), starts) for g in groups]

    def _make_bucket(self, batch: ForwardBatch, idx: list[int], starts: list[int]) -> _Bucket:
        device = batch.input_ids.device
        window = self.layout.sliding_window
        ext = [batch.extend_lens[i] for i in idx]
        prefix = [batch.prefix_lens[i] for i in idx]
        seq = [batch.seq_lens[i] for i in idx]
        max_q, max_len = max(ext), max(seq)
        uniform = min(ext) == max_q
        if len(idx) == batch.batch_size and uniform:
            src = dst = None  # the flat batch already is the padded layout
        else:
            # Built on the host, then one copy each.
            src = torch.cat(
                [
                    torch.arange(starts[i], starts[i] + batch.extend_lens[i], device="cpu")
                    for i in idx
                ]
            )
            dst = torch.cat([torch.arange(n, device="cpu") + j * max_q for j, n in enumerate(ext)])
            src, dst = to_device(src, device), to_device(dst, device)
        fresh = max(prefix) == 0 and (window is None or window >= max_q)
        if fresh:
            mask = None
            if not uniform:
                pos = torch.arange(max_q, device=device)
                lens = index_tensor(ext, device)
                allowed = (pos[None, None, :] <= pos[None, :, None]) & (
                    pos[None, None, :] < lens[:, None, None]
                )  # [reqs, q, k]
                mask = _additive(allowed[:, None])
            return _Bucket(len(idx), max_q, max_q, src, dst, None, mask)
        rows = batch.req_pool_indices[index_tensor(idx, device)]
        kv_index = self.req_to_token.table[rows, :max_len].reshape(-1)
        key_pos = torch.arange(max_len, device=device)
        q_pos = index_tensor(prefix, device)[:, None] + torch.arange(max_q, device=device)
        allowed = key_pos[None, None, :] <= q_pos[:, :, None]  # [reqs, q, max_len]
        if window is not None:
            allowed &= key_pos[None, None, :] > q_pos[:, :, None] - window
        return _Bucket(len(idx), max_q, max_len, src, dst, kv_index, _additive(allowed[:, None]))

    def _forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        layout = self.layout
        heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        out = q.new_empty(q.shape[0], heads * dim) if len(self._buckets) > 1 else None
        for b in self._buckets:
            rows = b.num_reqs * b.max_q
            qb = _to_padded(q, b, rows).reshape(b.num_reqs, b.max_q, heads, dim).transpose(1, 2)
            if b.kv_index is None:
                kb = _to_padded(k, b, rows).reshape(b.num_reqs, b.max_q, kv_heads, dim)
                vb = _to_padded(v, b, rows).reshape(b.num_reqs, b.max_q, kv_heads, dim)
                kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)
            else:
                kb, vb = self._gather(layer_id, b.kv_index, b.num_reqs, b.max_len)
            ob = _sdpa_gqa(qb, kb, vb, b.mask, layout.scaling)  # [reqs, heads, max_q, dim]
            ob = ob.transpose(1, 2).reshape(rows, heads * dim)
            if out is None:
                return ob if b.dst_rows is None else ob[b.dst_rows]
            out[b.src_rows] = ob[b.dst_rows]
        return out

    # ---- shared -------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        if batch.mode is ForwardMode.DECODE:
            return self._forward_decode(q, layer_id, batch)
        return self._forward_extend(q, k, v, layer_id)

    def _gather(
        self, layer_id: int, kv_index: torch.Tensor, num_reqs: int, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[num_reqs, kv_heads, max_len, head_dim]` from the pool."""
        shape = (num_reqs, max_len, self.layout.num_kv_heads, self.layout.head_dim)
        keys = self.kv_pool.k_buffers[layer_id].index_select(0, kv_index).view(shape)
        values = self.kv_pool.v_buffers[layer_id].index_select(0, kv_index).view(shape)
        return keys.transpose(1, 2), values.transpose(1, 2)


def _to_padded(x: torch.Tensor, bucket: _Bucket, rows: int) -> torch.Tensor:
    """Flat `[num_tokens, heads, dim]` rows of the bucket -> `[rows, heads, dim]` padded."""
    if bucket.src_rows is None:
        return x
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[bucket.dst_rows] = x[bucket.src_rows]
    return padded


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """Boolean mask -> additive float mask (computed once per forward, not per layer)."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA with fewer KV heads than query heads; plain causal when `mask` is None."""
    causal = mask is None
    if mask is not None:
        mask = mask.to(q.dtype)
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    if not _HAS_ENABLE_GQA:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
