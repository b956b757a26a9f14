"""Per-layer K and V buffers indexed by KV slot.

Layout per layer: `[num_slots + 1, num_kv_heads, head_dim]` (row 0 is the padding slot).
The pool only stores and returns tensors; which slot belongs to whom is the allocator's
and the request-to-token table's business.
"""

from __future__ import annotations

import math
import mmap

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
        self.k_buffers = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffers = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys/values. slots: [num_tokens]; k, v: [num_tokens, num_kv_heads, head_dim]."""
        self.k_buffers[layer_id][slots] = k
        self.v_buffers[layer_id][slots] = v


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A buffer of zeros. On a CPU it lies in anonymous memory, which the OS hands out page
    by page as it is first written: a pool takes the memory of the tokens it has held, not
    its whole size at once (`torch.zeros` wrote every page: 3 GB for SmolLM2-135M's
    default pool of 65,536 tokens in float32, for an engine that had run nothing)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # (private: a forked process writes its own copy, as with `torch.zeros`)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
