"""Attention backends over the paged KV pool: a small contract and a lazy factory.

`create_attention_backend("torch" | "triton" | "native", ...)` imports the implementation
only when asked, so importing the runtime never imports Triton or compiles anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmprog_runtime.attention.base import AttentionLayout, BaseAttentionBackend

if TYPE_CHECKING:
    from lmprog_runtime.kvcache import KVPool, ReqToTokenPool


def create_attention_backend(
    name: str, layout: AttentionLayout, kv_pool: KVPool, req_to_token: ReqToTokenPool
) -> BaseAttentionBackend:
    if name == "torch":
        from lmprog_runtime.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(layout, kv_pool, req_to_token)
    if name == "triton":
        from lmprog_runtime.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(layout, kv_pool, req_to_token)
    if name == "native":
        from lmprog_runtime.attention.native_backend import NativeAttentionBackend

        return NativeAttentionBackend(layout, kv_pool, req_to_token)
    raise ValueError(
        f"attention backend {name!r} is not available; available: ['torch', 'native', 'triton']"
    )


__all__ = ["AttentionLayout", "BaseAttentionBackend", "create_attention_backend"]
