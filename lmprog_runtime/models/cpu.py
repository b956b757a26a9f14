"""What the CPU computes natively, read once from torch's own CPU feature detection."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run natively (several times float32's rate)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = capabilities()
        return bool(found.get("amx_bf16") or found.get("avx512_bf16"))
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
