"""The quantized decode kernels, one layer at a time (issue 17): bfloat16 activations (the
integer path on a CPU with AVX512-VNNI: activations rounded to int16 per block, VNNI dot
products) against float32 activations (blocks widened to float32, FMAs), on the same
quantized weights and the same values.

Layers are the shapes of SmolLM2-135M (hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64,
vocabulary 49,152): QKV, output, gate/up and down projections in Q4_1 and the Q8_0 LM head,
at 1 and 4 rows. Random weights (the kernels' speed does not depend on the values); each
side runs a loop of calls, the two sides alternating (`harness.alternate`), best of the
rounds. The weights stay in cache between calls, unlike a real decode step, where every
weight comes from memory once.

    .venv/bin/python benchmarks/bench_quant_kernels.py [--repeats 5]
"""

from __future__ import annotations

import argparse

import harness
import torch
from harness import Phase

SHAPES = (  # name, method, out, in
    ("qkv", "int4", 960, 576),
    ("o", "int4", 576, 576),
    ("gate_up", "int4", 3072, 576),
    ("down", "int4", 576, 1536),
    ("LM head", "int8", 49152, 576),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=5)
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args()

    from lmprog_runtime.models.quantization import Q4Linear, Q8Linear

    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for name, method, out_features, in_features in SHAPES:
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.02)
        layer = (Q4Linear if method == "int4" else Q8Linear)(linear, float_output=True)
        if layer._native is None:
            raise SystemExit("the native kernels did not build: nothing to measure")
        for rows in (1, 4):
            x32 = torch.randn(rows, in_features, generator=gen).bfloat16().float()
            x16 = x32.bfloat16()  # the same values
            calls = 40 if out_features > 10_000 else 400

            def loop(x: torch.Tensor, layer=layer, calls=calls) -> None:
                with torch.no_grad():
                    for _ in range(calls):
                        layer(x)

            loop(x16)  # warm both paths
            loop(x32)
            phases = {
                "bfloat16": Phase("bfloat16 activations", lambda x=x16: loop(x)),
                "float32": Phase("float32 activations", lambda x=x32: loop(x)),
            }
            harness.alternate(list(phases.values()), args.repeats)
            best = {side: phase.best / calls * 1e6 for side, phase in phases.items()}
            weights = out_features * in_features * rows
            rows_out.append(
                {
                    "layer": f"{name} {out_features}x{in_features} ({method})",
                    "rows": rows,
                    "float32 activations (us)": f"{best['float32']:.1f}",
                    "bfloat16 activations (us)": f"{best['bfloat16']:.1f}",
                    "speedup": f"{best['float32'] / best['bfloat16']:.2f}x",
                    "bfloat16 weights x rows / s": f"{weights / best['bfloat16'] / 1e3:.1f} G",
                }
            )
            print(rows_out[-1], flush=True)
    args.dtype = "float32 and bfloat16 activations, per column"
    vnni = harness.machine_info()["cpu_flags"].get("avx512_vnni", False)
    note = "the integer VNNI path" if vnni else "no AVX512-VNNI here: the float path too"
    harness.write_result(
        args,
        "quant_kernels",
        {
            "title": f"Quantized decode kernels: bfloat16 activations ({note}) vs float32",
            "workload": (
                "one call of a quantized linear layer at SmolLM2-135M's shapes, random "
                f"weights, weights in cache; best of {args.repeats} alternating rounds"
            ),
            "columns": list(rows_out[0]),
            "rows": rows_out,
        },
    )


if __name__ == "__main__":
    main()
