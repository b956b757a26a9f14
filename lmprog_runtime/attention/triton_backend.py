"""The Triton backend: store, extend and split-KV decode kernels over the paged pool.

The default on CUDA. On CPU it runs only under `TRITON_INTERPRET=1` (slowly: that is how
its tests check it against the torch reference).

A mixed extend (new prompts plus running requests decoding one token each, see
`ForwardBatch.num_decodes`) runs its two parts with their own kernels into one output:
the decode kernel reads each KV head once per group of query heads and splits long
sequences, where the extend kernel would spend a whole block of query rows on one token.

CUDA graphs (`supports_cuda_graph`): a graph batch is planned from its device tensors and
its size alone. Its split count comes from the batch size and the table's context length,
never from the lengths on the host (those of the capture are not those of the replays).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from lmprog_runtime.attention.base import AttentionLayout, BaseAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
from lmprog_runtime.transfer import to_device


class _ExtendPlan(NamedTuple):
    """Per-forward arguments of `extend_attention` (tensors of [num_reqs] int64)."""

    num_tokens: int
    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_starts: torch.Tensor
    max_extend: int


class _DecodePlan(NamedTuple):
    """Per-forward arguments of `decode_attention` (tensors of [num_reqs] int64)."""

    req_rows: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: int


class TritonAttentionBackend(BaseAttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self, layout: AttentionLayout, kv_pool: KVPool, req_to_token: ReqToTokenPool
    ) -> None:
        super().__init__(layout, kv_pool, req_to_token)
        device = kv_pool.k_buffers[0].device
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU needs TRITON_INTERPRET=1 (slow; for tests)"
            )
        from lmprog_runtime.attention import triton_decode, triton_kernels

        self._kernels = triton_kernels  # store and extend
        self._decode_kernels = triton_decode
        self._extend: _ExtendPlan | None = None
        self._decode: _DecodePlan | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._extend = self._decode = None
        if batch.mode is ForwardMode.DECODE:
            self._decode = self._plan_decode(batch)
        elif batch.num_decodes:  # a mixed extend: [extend requests ; decode requests]
            extend, decode = batch.split_decodes()
            self._extend = self._plan_extend(extend)
            self._decode = self._plan_decode(decode)
        else:
            self._extend = self._plan_extend(batch)

    def _plan_extend(self, batch: ForwardBatch) -> _ExtendPlan:
        extend_lens = batch.extend_lens
        starts = [0]
        for n in extend_lens[:-1]:
            starts.append(starts[-1] + n)
        # [3, num_reqs]: one copy to the device, one row per argument.
        prefix_lens, lens, extend_starts = self._tensor([batch.prefix_lens, extend_lens, starts])
        return _ExtendPlan(
            num_tokens=sum(extend_lens),
            req_rows=batch.req_pool_indices,
            prefix_lens=prefix_lens,
            extend_lens=lens,
            extend_starts=extend_starts,
            max_extend=max(extend_lens),
        )

    def _plan_decode(self, batch: ForwardBatch) -> _DecodePlan:
        if batch.is_cuda_graph:
            # Any length up to the context can come with a replay.
            max_len = self.req_to_token.context_len
        else:
            max_len = max(batch.seq_lens)
        window = self.layout.sliding_window
        if window is not None:
            max_len = min(max_len, window)  # no request attends to more keys
        num_splits = self._decode_kernels.choose_num_splits(
            batch.batch_size, self.layout.num_kv_heads, max_len, self.req_to_token.table.device
        )
        seq_lens = batch.seq_lens_device
        if seq_lens is None:
            assert not batch.is_cuda_graph, "graph batches carry device lengths"
            seq_lens = self._tensor(batch.seq_lens)
        return _DecodePlan(batch.req_pool_indices, seq_lens, num_splits)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64, device="cpu")
        return to_device(host, self.req_to_token.table.device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        kern = self._kernels
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        kern.store_kv(k.contiguous(), v.contiguous(), k_buf, v_buf, batch.out_cache_loc)
        window = self.layout.sliding_window or 0
        table = self.req_to_token.table
        scale = self.layout.scaling
        # [num_tokens, num_heads, head_dim]: extend rows first, then decode rows; the
        # kernels read q through its strides and write their rows of out in place.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_extend = 0
        if (e := self._extend) is not None:
            num_extend = e.num_tokens
            kern.extend_attention(
                q[:num_extend],
                k_buf,
                v_buf,
                table,
                e.req_rows,
                e.prefix_lens,
                e.extend_lens,
                e.extend_starts,
                e.max_extend,
                scale,
                window,
                out=out[:num_extend],
            )
        if (d := self._decode) is not None:
            self._decode_kernels.decode_attention(
                q[num_extend:],
                k_buf,
                v_buf,
                table,
                d.req_rows,
                d.seq_lens,
                scale,
                window,
                d.num_splits,
                out=out[num_extend:],
            )
        return out.view(q.shape[0], -1)
