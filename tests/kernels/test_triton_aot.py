"""The Triton kernels compiled for GPUs that are not here: sm_90 (H100 / H200) and sm_80
(A100), by `benchmarks/triton_aot.py`, down to cubins through the `ptxas` shipped with
Triton, with the specialization a launch on that GPU would get.

The interpreter tests (`test_triton.py`, `test_triton_ops.py`) check what the kernels
compute; these check what only a compiler can: that every launch the runtime makes
compiles, at every attention layout and dtype; that no kernel spills registers; that each
block's shared memory fits; that 16-bit attention multiplies on tensor cores (wgmma on
sm_90 for extend, mma.sync for decode's 16-row head groups) and float32 attention not in
TF32 (its contract: full float32 products).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_aot.py"
sys.path.insert(0, str(SCRIPT.parent))
import triton_aot  # noqa: E402  (the script's constants; it compiles only in a subprocess)

ARCHS = (90, 80)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, list[dict]]:
    """Each architecture's rows, compiled in two processes at once (about a minute cold;
    Triton's cache makes reruns take seconds). The interpreter must be off in them."""
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {
        arch: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--arch", str(arch), "--json", str(out / f"{arch}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in ARCHS
    }
    try:
        results = {arch: proc.communicate(timeout=900) for arch, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # a no-op once exited; ends the other one if one timed out
    for arch, proc in procs.items():
        if proc.returncode == triton_aot.UNSUPPORTED_TRITON:
            pytest.skip(results[arch][1].strip())
        assert proc.returncode == 0, f"sm_{arch}:\n{results[arch][1][-4000:]}"
    return {arch: json.loads((out / f"{arch}.json").read_text())["rows"] for arch in ARCHS}


def _launches() -> set[str]:
    """Every (case prefix, launch) label the script must have compiled."""
    labels = {"sampler: race"}
    for dtype in triton_aot.DTYPES:
        for layout in triton_aot.LAYOUTS:
            labels |= {f"{layout} {dtype}: store_kv", f"{layout} {dtype}: extend"}
        labels |= {f"{dtype}: silu_and_mul intermediate={n}" for n in triton_aot.INTERMEDIATE_SIZES}
        for hidden in triton_aot.HIDDEN_SIZES:
            labels |= {
                f"{dtype}: rms_norm hidden={hidden}",
                f"{dtype}: add_rms_norm hidden={hidden}",
            }
    return labels


@pytest.mark.parametrize("arch", ARCHS)
def test_every_launch_compiles(reports, arch):
    rows = reports[arch]
    cases = {row["case"] for row in rows}
    assert _launches() <= cases
    for dtype in triton_aot.DTYPES:
        for layout in triton_aot.LAYOUTS:
            decode = [r for r in rows if r["case"].startswith(f"{layout} {dtype}: decode")]
            kernels = {r["kernel"] for r in decode}
            assert kernels == {"_decode_stage1_kernel", "_decode_stage2_kernel"}, (layout, dtype)
            # A CUDA graph's fixed split count and a single split are among them.
            assert any("splits=16" in r["case"] for r in decode)
            assert any(r["case"].endswith("splits=1") for r in decode)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_kernel_spills_registers_and_shared_memory_fits(reports, arch):
    limits = triton_aot.LIMITS[arch]
    spills = [(r["case"], r["kernel"], r["spill_bytes"]) for r in reports[arch] if r["spill_bytes"]]
    assert spills == []
    for row in reports[arch]:
        assert row["shared_bytes"] <= limits.shared_per_block, row
        assert row["registers"] <= 255 and row["blocks_per_sm"] >= 1, row


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_multiplies_on_tensor_cores_in_16_bits_and_never_in_tf32(reports, arch):
    attention = ("_extend_kernel", "_decode_stage1_kernel")
    for row in reports[arch]:
        if row["kernel"] not in attention:
            continue
        dtype = row["case"].split(":")[0].split()[-1]
        if dtype == "float32":
            assert row["mma"] == [], row  # FMA units: no TF32 (or any) tensor-core product
            continue
        operand = {"bfloat16": "bf16", "float16": "f16"}[dtype]
        wanted = (
            "wgmma.mma_async" if arch >= 90 and row["kernel"] == "_extend_kernel" else "mma.sync"
        )
        assert any(m.startswith(wanted) and f".{operand}." in m for m in row["mma"]), row


def test_blocks_per_sm_counts_the_scarcest_resource():
    h200 = triton_aot.LIMITS[90]
    assert triton_aot.blocks_per_sm(104, 4, 39424, h200) == 4  # registers: 4 x 13,312
    assert triton_aot.blocks_per_sm(32, 4, 100 * 1024, h200) == 2  # shared memory
    assert triton_aot.blocks_per_sm(16, 4, 0, h200) == 16  # 64 warps / 4
    assert triton_aot.blocks_per_sm(16, 1, 0, h200) == 32  # the block cap
