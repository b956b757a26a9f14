"""bfloat16 linear layers that multiply decode batches on AMX tiles, or by AVX512-BF16 dot
products on CPUs without AMX.

A decode step reads every weight for a few rows of arithmetic, so its matmuls run at the
speed of streaming the weights. torch's bfloat16 matmul (oneDNN) stays well below that at
decode batch sizes: on SmolLM2-135M's 30 layers at 32 rows, 26.9 ms against 14.3 ms for
`csrc/amx_linear.cpp` over weights packed once into AMX's tile layout (1.9x; 2.4x at one
row; best of 6 alternating rounds, one 2-core Xeon). Without AMX, the same packed layout
feeds AVX512-BF16's vdpbf16ps: on a 2-core AMD Zen 4, 2.9x faster at one row, 1.7x at 32
(`benchmarks/bench_packed_linears.py`). On the CPUs that have either, bfloat16 models
swap each `nn.Linear` for an `AMXLinear` at load: it keeps the same weight and bias
(the same Parameters: tied embeddings stay tied, the state dict is unchanged) plus the
packed copy, which it uses for up to `max_rows` rows (32 on AMX tiles, 256 by AVX512-BF16
dot products: `amx_linear_max_rows` in the kernel says why); more rows (prefills) take
`F.linear`, which is faster there. The copy costs the weights' memory once more; when that
would exceed a quarter of the free host memory, or with `disable_amx_linears`, the layers
stay as they are.

Products of bfloat16 values are exact in float32 and the output is rounded once, as in
`F.linear`; only the summation order may differ (it did not at these shapes: the outputs
were bitwise equal). A weight replaced or changed in place is packed again on next use.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from lmprog_runtime.models.ops import TorchOps

logger = logging.getLogger(__name__)

_OUT_BLOCK, _IN_CHUNK = 16, 32  # outputs per tile block, inputs per tile row


def pack_for_amx(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """w [out, in] -> [out / 16, in / 32, 16, 32]: per block of 16 outputs and chunk of 32
    inputs, row r holds for each output j its inputs 2r and 2r + 1 (AMX's second operand).
    `gated` (a gated MLP's fused gate/up weight, [gate; up]): the blocks go in pairs, gate
    outputs 16p .. 16p + 15 then the same up outputs, for `amx_gated`."""
    n, k = weight.shape
    weight = weight.detach()
    if gated:
        weight = weight.reshape(2, n // (2 * _OUT_BLOCK), _OUT_BLOCK, k).transpose(0, 1)
    blocks = weight.reshape(n // _OUT_BLOCK, _OUT_BLOCK, k // _IN_CHUNK, _IN_CHUNK // 2, 2)
    return (
        blocks.permute(0, 2, 3, 1, 4).reshape(n // _OUT_BLOCK, k // _IN_CHUNK, 16, 32).contiguous()
    )


class AMXLinear(nn.Module):
    """`linear` (bfloat16, CPU) with a copy of its weight packed for AMX tiles.

    `gated`: `linear` is a gated MLP's fused gate/up projection ([gate; up] outputs, no
    bias) and its copy is packed by pairs of gate and up blocks, where `amx_gated` can run
    (AVX512-BF16, no AMX): `gated_activation` then computes silu(gate) * up with the product,
    at every row count (a prefill's [rows, 2 * inter] output is never written), and
    `forward` takes `F.linear`. Elsewhere the layer is not gated."""

    def __init__(self, linear: nn.Linear, native: ModuleType, gated: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._native = native
        self.max_rows = int(native.amx_linear_max_rows())  # more rows: F.linear
        self.gated = (
            gated
            and native.amx_gated_available()
            and linear.bias is None
            and self.out_features % (2 * _OUT_BLOCK) == 0
        )
        self.register_buffer("packed", self._pack(), persistent=False)
        self._packed_from = self._weight_state()  # (id, version) of the weight packed

    def _weight_state(self) -> tuple[int, int]:
        return id(self.weight), self.weight._version

    def packed_weight(self) -> torch.Tensor:
        """The packed weight, packed again if the weight was replaced or changed in place."""
        if self._packed_from != self._weight_state():
            self.packed = self._pack()
            self._packed_from = self._weight_state()
        return self.packed

    def _pack(self) -> torch.Tensor:
        return pack_for_amx(self.weight, self.gated)

    def is_current(self) -> bool:
        return self._packed_from == self._weight_state()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (
            self.gated  # the packed copy is in pair order
            or rows > self.max_rows
            or x.dtype != torch.bfloat16
            or x.device.type != "cpu"
        ):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        out = self._native.amx_linear(flat, self.packed_weight(), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def gated_activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the gated MLP whose fused gate/up projection this is ([...,
        2 * inter] -> [..., inter]): in one pass with the product where the layer is `gated`
        (gate and up rounded to bfloat16 first, as `forward`'s output would be; the
        activation in float32, to within the kernel's exponential, a few parts per million,
        of `silu_and_mul`), else `forward` and then `TorchOps.silu_and_mul`."""
        if not (self.gated and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
            return TorchOps.silu_and_mul(self(x))
        out = self._native.amx_gated(x.reshape(-1, self.in_features), self.packed_weight())
        return out.reshape(*x.shape[:-1], self.out_features // 2)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_amx_linears(model: nn.Module, free_bytes: int) -> int:
    """Swap the model's bfloat16 `nn.Linear` layers (outputs a multiple of 16, inputs of
    32) for `AMXLinear`, in place, where the native kernels and AMX or AVX512-BF16 are
    available and the packed copies take at most a quarter of `free_bytes`. Returns how
    many were swapped."""
    from lmprog_runtime.native import load_native

    try:
        native = load_native()
    except RuntimeError:
        return 0
    if not native.amx_linear_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is nn.Linear
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
        and child.out_features % _OUT_BLOCK == 0
        and child.in_features % _IN_CHUNK == 0
    ]
    extra = sum(child.weight.numel() * child.weight.element_size() for _, _, child in targets)
    if extra > free_bytes // 4:
        logger.info(
            "not packing linear weights for AMX: the copies (%d MiB) exceed a quarter of the "
            "free memory (%d MiB)",
            extra >> 20,
            free_bytes >> 20,
        )
        return 0
    for parent, name, child in targets:
        # Every decoder MLP's gate/up projection feeds silu_and_mul (`llama.MLP`).
        setattr(parent, name, AMXLinear(child, native, gated=name == "gate_up_proj"))
    return len(targets)
