"""The reference attention backend: gather each request's K/V from the pool, then SDPA.

Correct for any mix of cached prefixes, new tokens and lengths; other backends are tested
against this one. Two paths:
- extend with no cached prefix in the batch: attend over the new tokens' own k/v (no pool
  gather), causal, grouped-query heads handled by SDPA;
- everything else (decode, extend after a prefix): gather `[batch, kv_heads, max_len, dim]`
  from the pool through the request-to-token table. The query heads that share a KV head are
  folded into the query-length axis, `[batch, kv_heads, group * q_len, head_dim]`, so K/V
  are never copied per query head; the mask is repeated to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmprog_runtime.attention.base import BaseAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode


class TorchAttentionBackend(BaseAttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        window = self.layout.sliding_window
        group = self.layout.num_heads // self.layout.num_kv_heads
        max_len = max(batch.seq_lens)
        self._max_len = max_len
        self._pad_index = None
        key_pos = torch.arange(max_len, device=device)

        if batch.mode is ForwardMode.DECODE:
            self._is_fresh = False
            self._kv_index = self.req_to_token.table[batch.req_pool_indices, :max_len].reshape(-1)
            self._max_q_len = 1
            uniform = min(batch.seq_lens) == max_len
            if uniform and (window is None or window >= max_len):
                self._mask = None
                return
            seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
            q_pos = (seq_lens - 1)[:, None]  # [batch, 1]
            mask = key_pos[None, :] <= q_pos
            if window is not None:
                mask &= key_pos[None, :] > q_pos - window
            self._mask = mask[:, None, None, :]  # [batch, 1, 1, max_len]
            return

        extend_lens = batch.extend_lens
        max_q = max(extend_lens)
        self._max_q_len = max_q
        uniform = min(extend_lens) == max_q
        if not uniform:
            self._pad_index = torch.cat(
                [torch.arange(n, device=device) + b * max_q for b, n in enumerate(extend_lens)]
            )
        self._is_fresh = max(batch.prefix_lens) == 0 and (window is None or window >= max_q)
        if self._is_fresh:
            # Keys are the new tokens themselves: causal, plus key validity when padded.
            if uniform:
                self._mask = None
            else:
                lens = torch.tensor(extend_lens, dtype=torch.int64, device=device)
                pos = torch.arange(max_q, device=device)
                causal = pos[None, :] <= pos[:, None]  # [max_q, max_q]
                valid = pos[None, :] < lens[:, None]  # [batch, max_q]
                self._mask = (causal[None] & valid[:, None, :])[:, None]  # [batch, 1, q, k]
            return
        self._kv_index = self.req_to_token.table[batch.req_pool_indices, :max_len].reshape(-1)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        q_pos = prefix[:, None] + torch.arange(max_q, device=device)[None, :]  # [batch, max_q]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [batch, max_q, max_len]
        if window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        self._mask = mask[:, None].repeat(1, 1, group, 1)  # [batch, 1, group * max_q, max_len]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        if self._is_fresh:
            return self._forward_fresh(q, k, v, batch)
        layout = self.layout
        bsz, max_len, max_q = batch.batch_size, self._max_len, self._max_q_len
        kv_heads, head_dim = layout.num_kv_heads, layout.head_dim
        group = layout.num_heads // kv_heads
        # [batch, kv_heads, max_len, head_dim]
        keys = self.kv_pool.k_buffers[layer_id].index_select(0, self._kv_index)
        keys = keys.view(bsz, max_len, kv_heads, head_dim).transpose(1, 2)
        values = self.kv_pool.v_buffers[layer_id].index_select(0, self._kv_index)
        values = values.view(bsz, max_len, kv_heads, head_dim).transpose(1, 2)

        q = self._pad(q, bsz, max_q)
        # [batch, max_q, kv_heads, group, head_dim] -> [batch, kv_heads, group * max_q, head_dim]
        q = q.reshape(bsz, max_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(bsz, kv_heads, group * max_q, head_dim)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=self._mask, scale=layout.scaling
        )
        # -> [batch * max_q, num_heads * head_dim]
        out = out.view(bsz, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        return self._unpad(out.reshape(bsz * max_q, layout.num_heads * head_dim))

    def _forward_fresh(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        layout = self.layout
        bsz, max_q = batch.batch_size, self._max_q_len
        # [batch, heads, max_q, head_dim]
        q = self._pad(q, bsz, max_q).reshape(bsz, max_q, layout.num_heads, -1).transpose(1, 2)
        k = self._pad(k, bsz, max_q).reshape(bsz, max_q, layout.num_kv_heads, -1).transpose(1, 2)
        v = self._pad(v, bsz, max_q).reshape(bsz, max_q, layout.num_kv_heads, -1).transpose(1, 2)
        out = _sdpa_gqa(q, k, v, self._mask, layout.scaling)
        out = out.transpose(1, 2).reshape(bsz * max_q, -1)
        return self._unpad(out)

    def _pad(self, x: torch.Tensor, bsz: int, max_q: int) -> torch.Tensor:
        """[num_tokens, heads, dim] -> [batch * max_q, heads, dim] (a view when uniform)."""
        if self._pad_index is None:
            return x
        padded = x.new_zeros(bsz * max_q, *x.shape[1:])
        padded[self._pad_index] = x
        return padded

    def _unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._pad_index is None else x[self._pad_index]


_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Causal SDPA with fewer KV heads than query heads; causal from `mask` when given."""
    if not _HAS_ENABLE_GQA and q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
