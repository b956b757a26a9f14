"""W8A8 linear layers (issue 17, `quantization="w8a8_int8"`): the packed VNNI kernel of
`csrc/w8a8_linear.cpp` against the same layer through torch's `_int_mm` (the same int8
rounding and rescaling around oneDNN's product), and the fused gate/up activation against
`_int_mm` + `silu_and_mul`; both beside a bfloat16 `F.linear` (+ `silu_and_mul`) over the
dequantized weights.

The 30 layers of SmolLM2-135M's shapes (QKV, output, gate/up, down), random weights, every
layer its own; bfloat16 activations. The sides alternate (`harness.alternate`), best of the
rounds. Needs AVX512-VNNI (the packed kernel).

    .venv/bin/python benchmarks/bench_w8a8_linears.py [--repeats 4]
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F
from bench_packed_linears import NUM_LAYERS, SHAPES  # the same 30 layers of SmolLM2 shapes
from harness import Phase
from torch import nn

ROWS = (1, 8, 32, 128, 256, 512, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=4)
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args()

    from lmprog_runtime.models.quantization import W8A8Linear
    from lmprog_runtime.native import load_native

    ops = load_native()
    if not ops.w8a8_packed_available():
        raise SystemExit("no AVX512-VNNI in this build: there is no packed kernel to compare")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(NUM_LAYERS):
        layer = []
        for n, k in SHAPES:
            linear = nn.Linear(k, n, bias=False)
            with torch.no_grad():
                linear.weight.copy_(0.02 * torch.randn(n, k, generator=gen))
            gated = n == SHAPES[2][0]
            layer.append(
                (W8A8Linear(linear, gated=gated), W8A8Linear(linear).dequantized(torch.bfloat16))
            )
        layers.append(layer)
    rows_out = []
    for rows in ROWS:
        xs = [torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES]

        def packed(xs=xs) -> None:
            for layer in layers:
                for x, (q, _) in zip(xs, layer):
                    if q.gated:
                        q.gated_activation(x)
                    elif x.shape[0] <= ops.w8a8_packed_max_rows():
                        ops.w8a8_linear(x, q.qweight, q.scales, q.packed)
                    else:  # past the packed kernel's rows the layer itself takes `_int_mm`
                        ops.w8a8_linear(x, q.qweight, q.scales)

        def int_mm(xs=xs) -> None:
            for layer in layers:
                for x, (q, _) in zip(xs, layer):
                    out = ops.w8a8_linear(x, q.qweight, q.scales)
                    if q.gated:
                        ops.silu_and_mul(out)

        def bf16(xs=xs) -> None:
            for layer in layers:
                for x, (q, w) in zip(xs, layer):
                    out = F.linear(x, w)
                    if q.gated:
                        ops.silu_and_mul(out)

        with torch.no_grad():
            for fn in (packed, int_mm, bf16):
                fn()
            phases = [Phase("packed", packed), Phase("_int_mm", int_mm), Phase("bf16", bf16)]
            harness.alternate(phases, args.repeats)
        ours, theirs, dense = (p.best for p in phases)
        flops = 2 * rows * NUM_LAYERS * sum(n * k for n, k in SHAPES)
        rows_out.append(
            {
                "rows": rows,
                "layer's path (ms)": f"{ours * 1e3:.2f}",
                "_int_mm path (ms)": f"{theirs * 1e3:.2f} ({theirs / ours:.2f}x)",
                "bfloat16 F.linear (ms)": f"{dense * 1e3:.2f} ({dense / ours:.2f}x)",
                "layer's rate (TOP/s)": f"{flops / ours / 1e12:.2f}",
            }
        )
    args.dtype = "int8 weights per channel, bfloat16 activations rounded to int8 per row"
    harness.write_result(
        args,
        f"w8a8_linears_{harness.bf16_kind()}",
        {
            "title": "W8A8 linears: the packed VNNI kernel and the fused gate/up against _int_mm",
            "workload": (
                f"the {NUM_LAYERS} layers' linears of SmolLM2-135M's shapes at each row count "
                "(the gate/up projection with its SiLU: the layer's fused activation, or the "
                "product then silu_and_mul); the layer's path is the packed kernel up to "
                "w8a8_packed_max_rows() rows and _int_mm beyond, the fused activation at "
                f"every count; best of {args.repeats} alternating rounds"
            ),
            "columns": list(rows_out[0]),
            "rows": rows_out,
        },
    )


if __name__ == "__main__":
    main()
