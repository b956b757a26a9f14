"""Every Triton kernel compiled ahead of time for GPUs that are not here, and what each uses.

The interpreter (`TRITON_INTERPRET=1`) checks what the kernels compute, not whether they
compile: it accepts tiles the compiler rejects and knows nothing of registers or shared
memory. This script runs the kernel wrappers on `meta` tensors (shapes without memory)
with the launch replaced by a compile for a chosen GPU target: Triton's own argument
binder gives the same specialization (dtypes, 16-byte alignment, constexprs) a launch on
that GPU would, and `triton.compile` runs the whole pipeline down to a cubin through the
`ptxas` shipped with Triton. No GPU or CUDA driver is needed.

For each compiled kernel it reports registers per thread, spilled bytes, shared memory, warps and pipeline stages, how many blocks fit on one streaming multiprocessor,
and the tensor-core instructions in its PTX. Cases: the attention layouts of the built-in
models and common real ones (GQA groups 1-7, head_dim 16-256), bfloat16 / float16 /
float32 pools, decode at the split counts the runtime uses (including a CUDA graph's
fixed count), extend, the KV store, the fused RMSNorm, SiLU-and-mul and RoPE, and the
sampler's keyed race and top-p floor search.

    .venv/bin/python benchmarks/triton_aot.py               # sm_90 (H100 / H200), a table
    .venv/bin/python benchmarks/triton_aot.py --arch 80 --json out.json

Run it without `TRITON_INTERPRET` (it refuses otherwise: under the interpreter
`triton.jit` builds no compilable kernels). `tests/kernels/test_triton_aot.py` asserts on
its report: everything compiles for sm_90 and sm_80, nothing spills, shared memory fits a
block, 16-bit attention uses tensor cores and float32 attention does not use TF32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# (query heads, KV heads, head_dim) of the attention layouts compiled.
LAYOUTS = {
    "tiny": (4, 2, 16),
    "small": (8, 4, 64),
    "gpu-check-medium": (16, 8, 64),
    "smollm2-135m": (9, 3, 64),
    "llama-2-7b": (32, 32, 128),
    "llama-3-8b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "gemma-7b": (16, 16, 256),
}
# Hidden and intermediate sizes for the fused elementwise ops (tiny .. llama-3-8b).
HIDDEN_SIZES = (64, 512, 576, 1024, 4096)
INTERMEDIATE_SIZES = (176, 1536, 2816, 14336)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Limits(NamedTuple):
    """Per streaming multiprocessor (and per block for shared memory), by compute capability."""

    regs: int
    shared_per_sm: int
    shared_per_block: int
    warps: int
    blocks: int


LIMITS = {
    80: Limits(65536, 164 * 1024, 163 * 1024, 64, 32),  # A100
    89: Limits(65536, 100 * 1024, 99 * 1024, 48, 24),  # L40S
    90: Limits(65536, 228 * 1024, 227 * 1024, 64, 32),  # H100 / H200
}
RESERVED_SHARED = 1024  # shared memory the driver keeps per block
UNSUPPORTED_TRITON = 3  # the exit status when this Triton lacks the JIT internals used


class UnsupportedTriton(RuntimeError):
    """This Triton's JIT lacks the binder internals the compile relies on (Triton 3.x)."""


class Compiled(NamedTuple):
    case: str
    kernel: Any  # triton.compiler.CompiledKernel


@contextlib.contextmanager
def compile_instead_of_launch(
    arch: int, sink: list[Compiled], case: Callable[[], str]
) -> Iterator[None]:
    """While open, `kernel[grid](...)` compiles the launch for sm_`arch` and appends it to
    `sink` (labelled `case()`) instead of running it. Uses Triton's JIT binder, so the
    specialization equals a real launch's (it relies on Triton 3.x's `JITFunction`)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit

    if knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    if not (
        hasattr(jit, "create_function_from_signature") and hasattr(jit.JITFunction, "_pack_args")
    ):
        raise UnsupportedTriton(f"Triton {triton.__version__}'s JITFunction has no binder to reuse")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)

    def compile_launch(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        # What `JITFunction.run` does before it asks the driver for a device.
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # (3.6 has one)
            if hasattr(knobs.compilation, knob):
                kwargs[knob] = getattr(knobs.compilation, knob)
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        source = ASTSource(self, signature, constexprs, attrs)
        compiled = triton.compile(source, target=target, options=options.__dict__)
        sink.append(Compiled(case(), compiled))
        return compiled

    launch = jit.JITFunction.run
    jit.JITFunction.run = compile_launch
    try:
        yield
    finally:
        jit.JITFunction.run = launch


# ---- the launches ---------------------------------------------------------------------
def _pool(num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(num_slots, kv_heads, head_dim, dtype=dtype, device="meta")


def _index(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int64, device="meta")


def attention_launches(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> Iterator[str]:
    """Run the store, extend and decode wrappers as the Triton backend calls them; yields the
    label of each launch just before it."""
    from lmprog_runtime.attention import triton_decode as td
    from lmprog_runtime.attention import triton_kernels as tk

    context_len = 4096
    k_buf = _pool(64 * context_len, kv_heads, head_dim, dtype)
    v_buf = _pool(64 * context_len, kv_heads, head_dim, dtype)
    table = _index(65, context_len)
    scale = head_dim**-0.5
    yield "store_kv"
    k = torch.empty(512, kv_heads, head_dim, dtype=dtype, device="meta")
    tk.store_kv(k, k, k_buf, v_buf, _index(512))
    yield "extend"
    q = torch.empty(2048, heads, head_dim, dtype=dtype, device="meta")
    rows = _index(4)
    tk.extend_attention(q, k_buf, v_buf, table, rows, rows, rows, rows, 512, scale)
    # A graph's fixed count, one split (a short batch), and the count chosen for 64 x 4096.
    for batch in (1, 64):
        for num_splits in sorted(
            {td.MAX_DECODE_SPLITS, 1, td.choose_num_splits(batch, kv_heads, context_len)}
        ):
            yield f"decode b{batch} splits={num_splits}"
            q = torch.empty(batch, heads, head_dim, dtype=dtype, device="meta")
            rows = _index(batch)
            td.decode_attention(q, k_buf, v_buf, table, rows, rows, scale, 0, num_splits)


def elementwise_launches(dtype: torch.dtype) -> Iterator[str]:
    """The fused RMSNorm (with and without the residual add), SiLU-and-mul and RoPE."""
    from lmprog_runtime.models.triton_ops import TritonOps

    ops = TritonOps()
    tokens = 256
    for hidden in HIDDEN_SIZES:
        x = torch.empty(tokens, hidden, dtype=dtype, device="meta")
        weight = torch.empty(hidden, dtype=dtype, device="meta")
        yield f"rms_norm hidden={hidden}"
        ops.rms_norm(x, weight, 1e-6)
        yield f"add_rms_norm hidden={hidden}"
        ops.add_rms_norm(x, torch.empty_like(x), weight, 1e-6)
    for size in INTERMEDIATE_SIZES:
        yield f"silu_and_mul intermediate={size}"
        ops.silu_and_mul(torch.empty(tokens, 2 * size, dtype=dtype, device="meta"))
    for head_dim in sorted({head_dim for _, _, head_dim in LAYOUTS.values()}):
        yield f"rope head_dim={head_dim}"  # head counts are launch arguments, not constexprs
        q = torch.empty(tokens, 4, head_dim, dtype=dtype, device="meta")
        table = torch.empty(4096, head_dim, dtype=torch.float32, device="meta")
        ops.rope(q, q[:, :2], _index(tokens), table, table)


def race_launches() -> Iterator[str]:
    """The sampler's keyed race and top-p's floor search (float32 probabilities; the
    vocabulary a launch argument)."""
    from lmprog_runtime.triton_race import nucleus_floors, race

    probs = torch.empty(64, 49152, dtype=torch.float32, device="meta")
    yield "race"
    race(probs, torch.empty(64, 2, dtype=torch.int64, device="meta"))
    yield "nucleus floors"
    nucleus_floors(probs, torch.empty(64, dtype=torch.float32, device="meta"))


def cases(dtypes: list[str]) -> Iterator[tuple[str, Iterator[str]]]:
    for name in dtypes:
        dtype = DTYPES[name]
        for layout, shape in LAYOUTS.items():
            yield f"{layout} {name}", attention_launches(*shape, dtype)
        yield name, elementwise_launches(dtype)
    yield "sampler", race_launches()


# ---- the report -----------------------------------------------------------------------
def _resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack frame bytes of the cubin's kernel. A Triton kernel
    calls no functions (all inlined), so a stack frame holds spilled registers: it is the
    "bytes stack frame" of `ptxas -v`, whose LOCAL column stays 0 for spills."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text!r}")
    regs, stack = map(int, match.groups())
    return {"registers": regs, "spill_bytes": stack}


def blocks_per_sm(registers: int, warps: int, shared: int, limits: Limits) -> int:
    """Resident blocks per streaming multiprocessor: registers are allocated per warp in
    units of 256, shared memory per block with the driver's reservation added.

    Example:
        >>> blocks_per_sm(104, 4, 39424, LIMITS[90])  # 4 warps x 104 registers, 38.5 KiB
        4
    """
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = limits.regs // (regs_per_warp * warps)
    by_shared = limits.shared_per_sm // (shared + RESERVED_SHARED) if shared else limits.blocks
    return min(by_regs, by_shared, limits.blocks, limits.warps // warps)


def describe(item: Compiled, limits: Limits) -> dict[str, Any]:
    meta = item.kernel.metadata
    ptx = item.kernel.asm["ptx"]
    row: dict[str, Any] = {
        "case": item.case,
        "kernel": meta.name,
        "warps": meta.num_warps,
        "stages": meta.num_stages,
        "shared_bytes": meta.shared,
        **_resources(item.kernel.asm["cubin"]),
        # Tensor-core instruction shapes in the PTX (mma.sync on sm_80+, wgmma on sm_90a).
        "mma": sorted(set(re.findall(r"\b((?:wgmma\.mma_async|mma)\.[\w.]+)", ptx))),
    }
    row["blocks_per_sm"] = blocks_per_sm(row["registers"], row["warps"], meta.shared, limits)
    row["occupancy"] = row["blocks_per_sm"] * row["warps"] / limits.warps
    return row


def compile_all(arch: int, dtypes: list[str]) -> list[dict[str, Any]]:
    """Compile every case for sm_`arch`; one row per compiled kernel (a decode launch is
    two), errors raised."""
    from lmprog_runtime.attention import triton_kernels

    limits = LIMITS[arch]
    compiled: list[Compiled] = []
    label = ""
    # The wrappers choose tiles by the device's compute capability: the target's.
    as_target = mock.patch.object(triton_kernels, "_capability", lambda _: divmod(arch, 10))
    with as_target, compile_instead_of_launch(arch, compiled, lambda: label):
        for prefix, launches in cases(dtypes):
            for name in launches:
                label = f"{prefix}: {name}"
    return [describe(item, limits) for item in compiled]


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'case':58} {'kernel':24} {'regs':>4} {'spill':>5} {'smem':>7} {'w':>2} {'st':>2} {'blk':>3} {'occ':>4}  mma"
    lines = [head]
    for r in rows:
        mma = ",".join(m.split(".")[0] + "." + m.split(".")[-2] for m in r["mma"]) or "-"
        lines.append(
            f"{r['case']:58} {r['kernel'][:24]:24} {r['registers']:>4} {r['spill_bytes']:>5} "
            f"{r['shared_bytes']:>7} {r['warps']:>2} {r['stages']:>2} {r['blocks_per_sm']:>3} "
            f"{r['occupancy']:>4.0%}  {mma}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(LIMITS))
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    parser.add_argument("--json", help="write the rows here instead of printing a table")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, quietly
    try:
        rows = compile_all(args.arch, args.dtypes.split(","))
    except UnsupportedTriton as e:
        print(e, file=sys.stderr)
        raise SystemExit(UNSUPPORTED_TRITON) from e
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "rows": rows}, indent=1))
    else:
        print(_table(rows))
    return rows


if __name__ == "__main__":
    main()
