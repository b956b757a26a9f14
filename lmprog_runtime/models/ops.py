"""The elementwise building blocks of the forward pass, in two interchangeable sets.

`TorchOps` is the reference (plain torch, numerics as in transformers); `NativeOps` calls the
fused C++ kernels of `csrc/fused_ops.cpp` (float32 or bfloat16 on CPU, float32 arithmetic
inside), one memory pass per op. The model holds one set and never branches on which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope(
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, heads, head_dim]; cos/sin rows: [num_tokens, 1, head_dim]
        cos = cos[positions].unsqueeze(1).to(q.dtype)
        sin = sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class NativeOps(TorchOps):
    """Fused C++ kernels over float32 or bfloat16 CPU tensors (the model holds one set; the
    runner picks this one with the native attention backend).

    Norm weights have the activations' dtype; RoPE tables are float32 or that dtype. RMSNorm
    rounds as the reference does (equal to it up to summation order); SiLU-and-mul and RoPE
    round once in bfloat16, where the reference rounds every intermediate product."""

    def __init__(self) -> None:
        from lmprog_runtime.native import load_native

        self._ops = load_native()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.add_rms_norm(x, residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.rope_(q, k, positions, cos, sin)
        return q, k
