"""The reference attention backend: gather each request's K/V from the pool, then SDPA.

Correct for any mix of cached prefixes, new tokens and lengths; not the fastest. Other
backends are tested against this one.

Grouped-query attention without copying K/V per query head: the query heads that share a
KV head are folded into the query-length axis, `[batch, kv_heads, group * q_len, head_dim]`,
and the mask is repeated to match.
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
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
        max_len = max(batch.seq_lens)
        # [batch * max_len] KV slots; entries past a request's length are masked out below.
        rows = self.req_to_token.table[batch.req_pool_indices, :max_len]
        self._kv_index = rows.reshape(-1)
        self._max_len = max_len
        key_pos = torch.arange(max_len, device=device)

        if batch.mode is ForwardMode.DECODE:
            self._pad_index = None
            self._max_q_len = 1
            uniform = min(batch.seq_lens) == max_len
            if uniform and (window is None or window >= max_len):
                self._mask = None
                return
            q_pos = (seq_lens - 1)[:, None]  # [batch, 1]
            mask = key_pos[None, :] <= q_pos
            if window is not None:
                mask &= key_pos[None, :] > q_pos - window
            self._mask = mask[:, None, None, :]  # [batch, 1, 1, max_len]
            return

        extend_lens = batch.extend_lens
        max_q = max(extend_lens)
        self._max_q_len = max_q
        if min(extend_lens) == max_q:
            self._pad_index = None
        else:
            self._pad_index = torch.cat(
                [
                    torch.arange(n, device=device) + b * max_q
                    for b, n in enumerate(extend_lens)
                ]
            )
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        q_pos = prefix[:, None] + torch.arange(max_q, device=device)[None, :]  # [batch, max_q]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [batch, max_q, max_len]
        if window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        self._mask = mask[:, None].repeat(1, 1, group, 1)  # [batch, 1, group * max_q, max_len]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        layout = self.layout
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        bsz, max_len, max_q = batch.batch_size, self._max_len, self._max_q_len
        kv_heads, head_dim = layout.num_kv_heads, layout.head_dim
        group = layout.num_heads // kv_heads
        # [batch, kv_heads, max_len, head_dim]
        keys = self.kv_pool.k_buffers[layer_id].index_select(0, self._kv_index)
        keys = keys.view(bsz, max_len, kv_heads, head_dim).transpose(1, 2)
        values = self.kv_pool.v_buffers[layer_id].index_select(0, self._kv_index)
        values = values.view(bsz, max_len, kv_heads, head_dim).transpose(1, 2)

        if self._pad_index is not None:
            padded = q.new_zeros(bsz * max_q, layout.num_heads, head_dim)
            padded[self._pad_index] = q
            q = padded
        # [batch, max_q, kv_heads, group, head_dim] -> [batch, kv_heads, group * max_q, head_dim]
        q = q.view(bsz, max_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(bsz, kv_heads, group * max_q, head_dim)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=self._mask, scale=layout.scaling
        )
        # -> [batch * max_q, num_heads * head_dim]
        out = out.view(bsz, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bsz * max_q, layout.num_heads * head_dim)
        if self._pad_index is not None:
            out = out[self._pad_index]
        return out
