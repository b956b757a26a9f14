"""The Triton backend: store, extend and split-KV decode kernels over the paged pool.

The default on CUDA. On CPU it runs only under `TRITON_INTERPRET=1` (slowly: that is how
its tests check it against the torch reference).
"""

from __future__ import annotations

import os

import torch

from lmprog_runtime.attention.base import AttentionLayout, BaseAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool


class TritonAttentionBackend(BaseAttentionBackend):
    def __init__(
        self, layout: AttentionLayout, kv_pool: KVPool, req_to_token: ReqToTokenPool
    ) -> None:
        super().__init__(layout, kv_pool, req_to_token)
        device = kv_pool.k_buffers[0].device
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU needs TRITON_INTERPRET=1 (slow; for tests)"
            )
        from lmprog_runtime.attention import triton_kernels

        self._kernels = triton_kernels

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._seq_lens = tensor(batch.seq_lens)
        if batch.mode is ForwardMode.EXTEND:
            extend_lens = batch.extend_lens
            starts = [0]
            for n in extend_lens[:-1]:
                starts.append(starts[-1] + n)
            self._prefix_lens = tensor(batch.prefix_lens)
            self._extend_lens = tensor(extend_lens)
            self._extend_starts = tensor(starts)
            self._max_extend = max(extend_lens)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        kern = self._kernels
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        kern.store_kv(k.contiguous(), v.contiguous(), k_buf, v_buf, batch.out_cache_loc)
        q = q.contiguous()
        window = self.layout.sliding_window or 0
        table = self.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            out = kern.decode_attention(
                q,
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices,
                self._seq_lens,
                self.layout.scaling,
                window,
            )
        else:
            out = kern.extend_attention(
                q,
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices,
                self._prefix_lens,
                self._extend_lens,
                self._extend_starts,
                self._max_extend,
                self.layout.scaling,
                window,
            )
        return out.reshape(q.shape[0], -1)
