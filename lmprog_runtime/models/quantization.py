"""Weight-only quantized linear layers: int8 per output channel, or int4 in groups of 32
with a scale and an offset per group (the Q4_1 layout).

Decode on a CPU reads every weight once per step, so it runs at the speed of memory: int8
weights are a quarter of float32's bytes, int4 an eighth. Layers are quantized at load
from the float weights (a GGUF's Q4_1 blocks, dequantized by the converter, come back to
the same integers: each block's minimum and maximum are representable values). The
matmuls are torch's weight-only kernels, which unpack the integers tile by tile and
multiply with float32 accumulation (an int8 layer given many rows at once dequantizes its
weight and runs one dense matmul instead). Those kernels are fast only for bfloat16
activations, so where the CPU computes bfloat16 natively the activations are rounded to
bfloat16 for the matmul (`compute_dtype`); elsewhere they stay as they are (correct, but
slower than a float matmul). The output layer (LM head) stays in float, as llama.cpp's quantized files
keep it at 6 or 8 bits: the logits decide the tokens, and the kernels return their
results in the activations' dtype. Embeddings stay in float (a lookup reads one row per
token).
"""

from __future__ import annotations

import torch
from torch import nn

from lmprog_runtime.config import QUANTIZATIONS
from lmprog_runtime.models.cpu import cpu_has_native_bf16

INT4_GROUP = 32
# From this many rows (a prefill, a large batch) an int8 layer dequantizes its weight and
# runs one dense matmul: torch's weight-only kernel is fast for a few rows only.
DEQUANTIZE_ROWS = 32
# _convert_weight_to_int4pack_for_cpu's packing parameter (inner K tiles of 16 values).
_INNER_K_TILES = 8


class QuantizedLinear(nn.Module):
    """Base of the quantized layers. `compute_dtype`: the activations' dtype inside the
    matmul (None: the input's own)."""

    compute_dtype: torch.dtype | None = None

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32."""
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale).T + bias, q int8 [out, in], one float scale per output row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype or x.dtype)
        scales = self.scales if self.scales.dtype == flat.dtype else self.scales.to(flat.dtype)
        if flat.shape[0] >= DEQUANTIZE_ROWS:  # a prefill: one matmul of the whole weight
            weight = self.qweight.to(flat.dtype) * scales[:, None]  # [out, in]
            out = torch.nn.functional.linear(flat, weight).to(x.dtype)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(QuantizedLinear):
    """y = x @ w.T + bias with w = q * scale + low per group of INT4_GROUP inputs, q in
    0..15, packed two per byte in the layout torch's CPU int4 kernel reads."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        weight = linear.weight.detach().float().reshape(out_features, -1, INT4_GROUP)
        low, high = weight.amin(dim=-1), weight.amax(dim=-1)  # [out, groups]
        scales = (high - low).clamp(min=1e-12) / 15.0
        q = torch.round((weight - low[..., None]) / scales[..., None]).clamp(0, 15)
        q = q.reshape(out_features, in_features).to(torch.int32)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        )
        # The kernel computes (q - 8) * scale + zero: zero = low + 8 * scale.
        # [groups, out, 2] (scale, zero), in the activations' dtype.
        scales_and_zeros = torch.stack([scales.t(), (low + 8 * scales).t()], dim=-1)
        dtype = linear.weight.dtype
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype).contiguous())
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32 (read back through the
        kernel itself: identity in, weight out)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, INT4_GROUP, self.scales_and_zeros.float()
        )
        return out.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype or x.dtype)
        scales_and_zeros = self.scales_and_zeros
        if scales_and_zeros.dtype != flat.dtype:
            scales_and_zeros = scales_and_zeros.to(flat.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, INT4_GROUP, scales_and_zeros
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the model's projections by `method` layers, in place (CPU only). Returns how many layers were quantized; one whose shape the kernel
    cannot take stays in float."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
    layer_type = Int8Linear if method == "int8" else Int4Linear
    compute_dtype = torch.bfloat16 if cpu_has_native_bf16() else None
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if name == "lm_head" or (method == "int4" and child.in_features % INT4_GROUP):
                continue
            layer = layer_type(child)
            layer.compute_dtype = compute_dtype
            setattr(parent, name, layer)
            count += 1
    return count
