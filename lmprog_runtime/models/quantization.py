"""Weight-only quantized linear layers in llama.cpp's block layouts: `"int8"` is Q8_0 (int8
values and a float16 scale per block of 32 inputs), `"int4"` is Q4_1 (4-bit values with a
float16 scale and minimum per block of 32).

Decode on a CPU reads every weight once per step, so it runs at the speed of memory: Q8_0
reads 1.06 bytes per weight, Q4_1 0.63, against float32's 4. A few rows at a time (decode)
go through the native kernels of `csrc/quant_linear.cpp`. With AVX-512 they widen each
block to float32 in registers and multiply it by float32 activations (the float32 matmul
over the dequantized weight up to summation order), or by bfloat16 activations rounded to
int16 per block where the CPU has VNNI. With AVX2 only, every activation dtype is rounded
to int16 per block (15 bits against the block's largest: far below the 1e-3 the tests
allow) and multiplied by the weights widened to int16. A decode batch (8 rows or more) of
bfloat16 activations on a CPU with AVX512-BF16 or AMX dequantizes 16 outputs at a time to
bfloat16 inside the kernel and multiplies every row by them, at the speed of a bfloat16
layer. Many rows at once (a prefill) dequantize the whole weight to the activations' dtype
and run one dense matmul; `dense_rows` says from how many. Without the native kernels
every call takes that dense path.

Layers are quantized at load from the float weights. A GGUF's Q8_0 and Q4_1 blocks,
dequantized by the converter, come back to the same integers and scales (each block's
extremes are representable values). The output layer (LM head) is quantized to Q8_0 with
either method, as llama.cpp's files keep it at 8 (or 6) bits; embeddings stay in float
(a lookup reads one row per token).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from lmprog_runtime.config import QUANTIZATIONS

logger = logging.getLogger(__name__)

BLOCK = 32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the activations the native kernels take


def dense_rows(native: ModuleType | None, dtype: torch.dtype) -> int:
    """From this many rows of `dtype` activations (a prefill, a large batch) a layer
    dequantizes its whole weight and runs one dense matmul; below it the native kernel, which
    reads each weight block once for all rows. The kernels know their crossover on this CPU:
    float32 16 rows with AVX-512, 64 with AVX2; bfloat16 the same, or 1024 where the CPU has
    AVX512-BF16 or AMX (from 8 rows the kernel dequantizes 16 outputs at a time to
    bfloat16 and multiplies every row by them there). Without the kernels, or for other
    dtypes, 0: every call is dense."""
    if native is None or dtype not in _KERNEL_DTYPES:
        return 0
    return int(native.quantized_dense_rows(dtype == torch.bfloat16))


class QuantizedLinear(nn.Module):
    """y = x @ w.T + bias over a block-quantized w [out, in]; in_features a multiple of 32.

    `float_output`: return float32 whatever the activations' dtype (the LM head: logits
    decide the tokens)."""

    def __init__(self, linear: nn.Linear, float_output: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % BLOCK:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {BLOCK}")
        self.bias = linear.bias
        self.float_output = float_output
        self._native = _native_kernels()
        self._dense_rows = {dtype: dense_rows(self._native, dtype) for dtype in _KERNEL_DTYPES}

    def dense_rows(self, dtype: torch.dtype) -> int:
        """From how many rows of `dtype` activations `forward` runs one dense matmul."""
        return self._dense_rows.get(dtype, 0)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies by, [out, in] (plain torch: the tests' reference)."""
        raise NotImplementedError

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized(dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] >= self.dense_rows(flat.dtype):
            out = F.linear(flat, self._dense_weight(flat.dtype))
            out = out.float() if self.float_output else out
        else:
            out = self._kernel(flat)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Q8Linear(QuantizedLinear):
    """Q8_0: w = q * d, q int8 in -127..127, d = max |w| / 127 per block (float16)."""

    def __init__(self, linear: nn.Linear, float_output: bool = False) -> None:
        super().__init__(linear, float_output)
        blocks = _blocks(linear.weight)  # [out, in / 32, 32]
        scales = (blocks.abs().amax(dim=-1) / 127).half()
        safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
        q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q.reshape(self.out_features, self.in_features))
        self.register_buffer("scales", scales)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        blocks = self.qweight.float().reshape(self.out_features, -1, BLOCK)
        weight = blocks * self.scales.float()[..., None]
        return weight.reshape(self.out_features, self.in_features).to(dtype)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self._native is None or dtype not in (torch.float32, torch.bfloat16):
            return self.dequantized(dtype)
        return self._native.q8_0_dequantize(self.qweight, self.scales, dtype == torch.bfloat16)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._native.q8_0_linear(x, self.qweight, self.scales, self.float_output)


class Q4Linear(QuantizedLinear):
    """Q4_1: w = q * d + m, q in 0..15, m the block's minimum and d its range / 15 (both
    float16). Two values per byte: byte j of a block holds element j in its low nibble and
    element j + 16 in its high nibble (llama.cpp's order)."""

    def __init__(self, linear: nn.Linear, float_output: bool = False) -> None:
        super().__init__(linear, float_output)
        blocks = _blocks(linear.weight)
        mins = blocks.amin(dim=-1).half()
        scales = ((blocks.amax(dim=-1) - mins.float()) / 15).half()
        safe = torch.where(scales == 0, torch.ones_like(scales), scales).float()
        q = torch.round((blocks - mins.float()[..., None]) / safe[..., None]).clamp(0, 15)
        q = q.to(torch.uint8)
        packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # [out, in / 32, 16]
        self.register_buffer("packed", packed.reshape(self.out_features, self.in_features // 2))
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        packed = self.packed.reshape(self.out_features, -1, BLOCK // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        weight = q * self.scales.float()[..., None] + self.mins.float()[..., None]
        return weight.reshape(self.out_features, self.in_features).to(dtype)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self._native is None or dtype not in (torch.float32, torch.bfloat16):
            return self.dequantized(dtype)
        return self._native.q4_1_dequantize(
            self.packed, self.scales, self.mins, dtype == torch.bfloat16
        )

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._native.q4_1_linear(x, self.packed, self.scales, self.mins, self.float_output)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)


def _native_kernels() -> ModuleType | None:
    from lmprog_runtime.native import load_native

    try:
        return load_native()
    except RuntimeError as error:
        logger.warning("native quantized kernels unavailable, using dense matmuls: %s", error)
        return None


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the model's projections by `method` layers and its LM head by a Q8_0 one, in
    place (CPU only). Returns how many layers were quantized; one whose inputs are not a
    whole number of blocks stays in float."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.in_features % BLOCK:
                continue
            if name == "lm_head":
                layer: QuantizedLinear = Q8Linear(child, float_output=True)
            else:
                layer = Q8Linear(child) if method == "int8" else Q4Linear(child)
            setattr(parent, name, layer)
            count += 1
    return count
