"""The native CPU backend: decode attention in C++ straight from the paged pool.

Decode reads each request's keys and values through the request-to-token table with no
padded gather (the reference backend's main cost at large batches). Extend (prefill) uses
the reference path. float32 on CPU only.
"""

from __future__ import annotations

import torch

from lmprog_runtime.attention.base import AttentionLayout
from lmprog_runtime.attention.torch_backend import TorchAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
from lmprog_runtime.native import load_native


class NativeAttentionBackend(TorchAttentionBackend):
    def __init__(
        self, layout: AttentionLayout, kv_pool: KVPool, req_to_token: ReqToTokenPool
    ) -> None:
        super().__init__(layout, kv_pool, req_to_token)
        if kv_pool.k_buffers[0].device.type != "cpu" or kv_pool.k_buffers[0].dtype != torch.float32:
            raise ValueError("attention_backend='native' runs float32 on CPU only")
        self._ops = load_native()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            self._seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
            # Requests that share a cached prefix share its first slot: process them
            # together so the prefix is read from memory once per step, not once each.
            first_slots = self.req_to_token.table[batch.req_pool_indices, 0]
            self._order = torch.argsort(first_slots, stable=True)
            return
        super().init_forward_metadata(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        if batch.mode is not ForwardMode.DECODE:
            return super().forward(q, k, v, layer_id, batch)
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        out = self._ops.decode_attention(
            q.contiguous(),
            self.kv_pool.k_buffers[layer_id],
            self.kv_pool.v_buffers[layer_id],
            self.req_to_token.table,
            batch.req_pool_indices,
            self._seq_lens,
            self._order,
            self.layout.scaling,
            self.layout.sliding_window or 0,
        )
        return out.view(q.shape[0], -1)
