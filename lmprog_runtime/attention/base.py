"""The attention backend contract.

A backend is told once per forward what the batch looks like (`init_forward_metadata`),
then called once per layer with the new tokens' q, k, v. It writes k and v into the KV pool
at `out_cache_loc` and returns attention over each request's whole sequence (cached prefix
plus new tokens, causal). The model never sees the pool; the backend never sees weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmprog_runtime.forward_batch import ForwardBatch
    from lmprog_runtime.kvcache import KVPool, ReqToTokenPool


@dataclass(frozen=True)
class AttentionLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    # Each query sees at most this many most recent keys (itself included); None = all.
    sliding_window: int | None = None


class BaseAttentionBackend(ABC):
    # True for a backend that, given a batch with `is_cuda_graph` set, plans its decode from
    # device tensors only (`seq_lens_device`, `req_pool_indices`) with launch shapes that
    # depend on the batch size alone: `cuda_graph.DecodeGraphRunner` captures only these.
    supports_cuda_graph: bool = False

    def __init__(self, layout: AttentionLayout, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.layout = layout
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute per-forward indices and masks shared by every layer."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

        Returns [num_tokens, num_heads * head_dim].
        """
