"""Per-layer K and V buffers indexed by KV slot.

Layout per layer: `[num_slots + 1, num_kv_heads, head_dim]` (row 0 is the padding slot).
The pool only stores and returns tensors; which slot belongs to whom is the allocator's
and the request-to-token table's business.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys/values. slots: [num_tokens]; k, v: [num_tokens, num_kv_heads, head_dim]."""
        self.k_buffers[layer_id][slots] = k
        self.v_buffers[layer_id][slots] = v
