"""Quantized linear layers at decode batch sizes (issue 17): the native Q8_0 ("int8") and
Q4_1 ("int4") kernels of `csrc/quant_linear.cpp` against what a float32 engine runs, torch's
`F.linear` over the float32 weights, and against the quantized layers' own dense path
(dequantize, then `F.linear`), over the 30 layers of SmolLM2-135M's shapes.

Random weights, every layer its own (about 400 MiB in float32, so each pass streams them
from memory as a decode step does); all sides multiply the same inputs, alternating
(`harness.alternate`), best of the rounds. The row counts reach past the kernels' own
threshold (`quantization.dense_rows`: where a layer switches to the dense path), so the
table shows where that crossover lies on this machine. Each kind of CPU writes a table of
its own (`quant_linears` on AMX, `quant_linears_<kind>` elsewhere).

`--activations bfloat16` multiplies bfloat16 activations instead, what a `dtype="auto"`
engine runs on a CPU with AMX or AVX512-BF16, against `F.linear` over bfloat16 weights and
the dense path in bfloat16; from 8 rows there the kernels dequantize blocks of 16 outputs
to bfloat16 themselves (table `quant_linears_bfloat16[_<kind>]`).

    .venv/bin/python benchmarks/bench_quant_linears.py [--repeats 5] [--activations bfloat16]
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F
from bench_packed_linears import NUM_LAYERS, SHAPES  # the same 30 layers of SmolLM2 shapes
from harness import Phase
from torch import nn

ROWS = (1, 4, 16, 32, 64, 128, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=5)
    parser.add_argument("--activations", choices=("float32", "bfloat16"), default="float32")
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args()
    dtype = getattr(torch, args.activations)

    from lmprog_runtime.models.quantization import Q4Linear, Q8Linear

    gen = torch.Generator().manual_seed(0)
    floats, q8, q4 = [], [], []
    for _ in range(NUM_LAYERS):
        for n, k in SHAPES:
            linear = nn.Linear(k, n, bias=False)
            with torch.no_grad():
                linear.weight.copy_(0.02 * torch.randn(n, k, generator=gen))
            floats.append(linear.weight.detach().to(dtype))
            q8.append(Q8Linear(linear))
            q4.append(Q4Linear(linear))
    if q8[0]._native is None:
        raise SystemExit("the native kernels did not build: nothing to compare")
    threshold = q8[0].dense_rows(dtype)
    nbytes = sum(w.numel() * 4 for w in floats)  # in float32
    rows_out = []
    for rows in ROWS:
        xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in SHAPES]

        def kernel(layers, xs=xs) -> None:
            for i, layer in enumerate(layers):
                layer._kernel(xs[i % len(SHAPES)])

        def dense(layers, xs=xs) -> None:
            for i, layer in enumerate(layers):
                F.linear(xs[i % len(SHAPES)], layer._dense_weight(dtype))

        def plain(xs=xs) -> None:
            for i, weight in enumerate(floats):
                F.linear(xs[i % len(SHAPES)], weight)

        phases = [
            Phase(f"F.linear {args.activations}", plain),
            Phase("int8 kernel", lambda: kernel(q8)),
            Phase("int4 kernel", lambda: kernel(q4)),
            Phase("int8 dense", lambda: dense(q8)),
            Phase("int4 dense", lambda: dense(q4)),
        ]
        with torch.inference_mode():
            for phase in phases:  # warm every side
                phase.run()
            harness.alternate(phases, args.repeats)
        base = phases[0].best
        row = {"rows": f"{rows}{' (dense from here)' if rows >= threshold else ''}"}
        row[f"F.linear {args.activations} (ms)"] = f"{base * 1e3:.1f}"
        for phase in phases[1:]:
            row[f"{phase.name} (ms)"] = f"{phase.best * 1e3:.1f} ({base / phase.best:.2f}x)"
        rows_out.append(row)
    kind = harness.bf16_kind()
    args.dtype = args.activations
    name = "quant_linears" if args.activations == "float32" else "quant_linears_bfloat16"
    harness.write_result(
        args,
        name if kind == "amx" else f"{name}_{kind}",
        {
            "title": "quantized linears at decode batch sizes: native kernels vs F.linear",
            "workload": (
                f"the {NUM_LAYERS} layers' linears of SmolLM2-135M's shapes ({nbytes >> 20} MiB "
                f"in float32, streamed from memory), {args.activations} activations, at each row "
                f"count; the kernels hand over to the dense path from {threshold} rows here; "
                f"speedup against F.linear {args.activations} in brackets; best of "
                f"{args.repeats} alternating rounds"
            ),
            "columns": list(rows_out[0]),
            "rows": rows_out,
        },
    )


if __name__ == "__main__":
    main()
