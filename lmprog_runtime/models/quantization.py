"""Quantized linear layers. Weight-only, in llama.cpp's block layouts: `"int8"` is Q8_0 (int8
values and a float16 scale per block of 32 inputs), `"int4"` is Q4_1 (4-bit values with a
float16 scale and minimum per block of 32). Weights and activations, `"w8a8_int8"`
(`W8A8Linear`): int8 weights with a scale per output channel, activations rounded to int8
per token at run time, int32 products.

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


class W8A8Linear(nn.Module):
    """y = x @ w.T + bias with w int8 per output channel (w = q * d, d = max |w| / 127 of its
    row) and x rounded to int8 per row as it arrives (x = qx * sx, sx = max |x| / 127 of the
    row, no clipping), the products summed in int32: SGLang's w8a8_int8.

    A CPU with AVX512-VNNI multiplies 64 byte pairs per instruction (torch's `_int_mm`,
    oneDNN; AMX-INT8 where present), twice a bfloat16 dot product's count, so a prefill's
    linears take about half the time of bfloat16 ones. The price is the activations'
    rounding: 8 bits against the row's largest value, coarser than bfloat16's 8 bits against
    each value's own magnitude (greedy outputs diverge from float32 sooner; see the README).
    An engine smooths the decoder's projection inputs before quantizing them
    (`models/smoothing.py`), which recovers about half of what the rounding costs.
    The native kernels round the rows and rescale the sums in one pass each
    (`csrc/w8a8_linear.cpp`), and multiply up to 256 rows (decode, small prefills) through a
    copy of the weight packed for vpdpbusd, `packed`, where the CPU has AVX512-VNNI; without
    them the same arithmetic runs as torch ops. The sums are exact, so every path gives the
    same output."""

    def __init__(self, linear: nn.Linear, float_output: bool = False, gated: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.float_output = float_output
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1) / 127
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(weight / safe[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self._native = _native_kernels()
        # A second copy, packed for the few-row kernel (AVX512-VNNI): decode steps and small
        # prefills. A gated MLP's gate/up projection (`gated`) pairs its gate and up blocks
        # instead, for `gated_activation`, which then takes every row count.
        self.gated = (
            gated
            and self.bias is None
            and self.out_features % 32 == 0
            and self._native is not None
            and self._native.w8a8_packed_available()
        )
        packed = None
        if self._native is not None and self._native.w8a8_packed_available():
            packed = self._native.w8a8_pack(q, self.gated)
        self.register_buffer("packed", packed)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies by, [out, in]."""
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self._native is not None and flat.dtype in _KERNEL_DTYPES:
            packed = None if self.gated else self.packed  # a gated pack is in pair order
            out = self._native.w8a8_linear(
                flat, self.qweight, self.scales, packed, self.bias, self.float_output
            )
        else:
            qx, sx = quantize_rows_int8(flat)
            sums = torch._int_mm(qx, self.qweight.t()).float()
            out = sums * (sx[:, None] * self.scales)
            out = out if self.bias is None else out + self.bias.float()
            out = out if self.float_output else out.to(flat.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def gated_activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gated MLP whose fused gate/up projection this is ([..., 2 *
        inter] -> [..., inter]), in one pass with the product where the layer is `gated`:
        gate and up are rounded to x's dtype first, as `forward`'s output would be before
        `silu_and_mul`, and the activation is computed in float32 (to within the kernel's
        exponential, a few parts per million, of g / (1 + e^-g) u)."""
        flat = x.reshape(-1, self.in_features)
        if self.gated and flat.dtype in _KERNEL_DTYPES:
            out = self._native.w8a8_gated(flat, self.scales, self.packed)
        else:
            gate, up = self(flat).float().chunk(2, dim=-1)
            out = (gate / (1 + torch.exp(-gate)) * up).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features // 2)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] rounded to int8 per row: (q, s) with x ~ q * s[:, None], s = max |x| / 127
    of the row (a zero row: q and s zero). Round half to even, as the native kernel."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    # A true quotient (torch's scalar / tensor multiplies by the reciprocal, a second rounding).
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return torch.round(x * inv[:, None]).to(torch.int8), amax / 127


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
    """Replace the model's projections by `method` layers and its LM head by a Q8_0 one (W8A8
    with "w8a8_int8": the activations' rounding there cost no more teacher-forced picks of
    SmolLM2-135M and saved a tenth of a decode step at 32 rows), in place (CPU only).
    Returns how many layers were quantized; a block-quantized one whose inputs are not a
    whole number of blocks stays in float."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            layer: nn.Module
            if method == "w8a8_int8":
                # Every decoder MLP's gate/up projection feeds silu_and_mul (`llama.MLP`).
                layer = W8A8Linear(
                    child, float_output=name == "lm_head", gated=name == "gate_up_proj"
                )
            elif child.in_features % BLOCK:
                continue
            elif name == "lm_head":
                layer = Q8Linear(child, float_output=True)
            else:
                layer = Q8Linear(child) if method == "int8" else Q4Linear(child)
            setattr(parent, name, layer)
            count += 1
    return count
