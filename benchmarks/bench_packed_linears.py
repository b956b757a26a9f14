"""bfloat16 linear layers at decode batch sizes (issue 17): the packed kernel of
`csrc/amx_linear.cpp` (AMX tiles, or AVX512-BF16 dot products on CPUs without AMX) against
torch's `F.linear`, over the 30 layers of SmolLM2-135M's shapes (QKV, output, gate/up, down).

Random weights, every layer its own (about 212 MB in bfloat16, so each pass streams them
from memory as a decode step does); both sides read the same weights and inputs, the two
alternating (`harness.alternate`), best of the rounds. Each kind of machine writes a table
of its own (`packed_linears` on AMX, `packed_linears_avx512_bf16` elsewhere).

    .venv/bin/python benchmarks/bench_packed_linears.py [--repeats 6]
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F
from harness import Phase

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # out, in: qkv, o, gate_up, down
NUM_LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=6)
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args()

    from lmprog_runtime.models.amx_linear import pack_for_amx
    from lmprog_runtime.native import load_native

    ops = load_native()
    kind = harness.bf16_kind()
    if not ops.amx_linear_available():
        raise SystemExit("no AMX or AVX512-BF16 on this machine: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    weights = [
        [(0.02 * torch.randn(n, k, generator=gen)).bfloat16() for n, k in SHAPES]
        for _ in range(NUM_LAYERS)
    ]
    packed = [[pack_for_amx(w) for w in layer] for layer in weights]
    nbytes = sum(w.numel() * 2 for layer in weights for w in layer)
    name = "AMX tiles" if kind == "amx" else "AVX512-BF16 dot products"
    rows_out = []
    for rows in ROWS:
        xs = [torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES]

        def ours(xs=xs) -> None:
            for layer in packed:
                for x, p in zip(xs, layer):
                    ops.amx_linear(x, p)

        def theirs(xs=xs) -> None:
            for layer in weights:
                for x, w in zip(xs, layer):
                    F.linear(x, w)

        ours()  # warm both
        theirs()
        phases = [Phase("packed kernel", ours), Phase("F.linear", theirs)]
        harness.alternate(phases, args.repeats)
        mine, torch_s = phases[0].best, phases[1].best
        rows_out.append(
            {
                "rows": rows,
                f"{name} (ms)": f"{mine * 1e3:.1f}",
                "F.linear (ms)": f"{torch_s * 1e3:.1f}",
                "speedup": f"{torch_s / mine:.2f}x",
                "weights streamed (GB/s, ours / F.linear)": (
                    f"{nbytes / mine / 1e9:.1f} / {nbytes / torch_s / 1e9:.1f}"
                ),
            }
        )
    args.dtype = "bfloat16"
    harness.write_result(
        args,
        "packed_linears" if kind == "amx" else f"packed_linears_{kind}",
        {
            "title": f"bfloat16 linears at decode batch sizes: {name} vs F.linear",
            "workload": (
                f"the {NUM_LAYERS} layers' linears of SmolLM2-135M's shapes ({nbytes >> 20} MiB "
                f"of bfloat16 weights, streamed from memory) at each row count; best of "
                f"{args.repeats} alternating rounds"
            ),
            "columns": list(rows_out[0]),
            "rows": rows_out,
        },
    )


if __name__ == "__main__":
    main()
