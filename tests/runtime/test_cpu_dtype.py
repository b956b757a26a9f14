"""`dtype="auto"` on a CPU (issue 17): bfloat16 for a 16-bit checkpoint where the CPU
computes bfloat16 natively (AMX or AVX512-BF16), float32 otherwise and for float32
checkpoints (the built-in test models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmprog_runtime import memory_plan
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.models.cpu import cpu_has_native_bf16


@pytest.mark.parametrize(
    ("stored", "native_bf16", "expected"),
    [
        ("bfloat16", True, torch.bfloat16),
        ("float16", True, torch.bfloat16),
        ("bfloat16", False, torch.float32),
        ("float32", True, torch.float32),
        (None, True, torch.bfloat16),  # no dtype recorded: a 16-bit checkpoint
    ],
)
def test_auto_dtype_on_cpu(tmp_path, monkeypatch, stored, native_bf16, expected):
    config = {} if stored is None else {"torch_dtype": stored}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(memory_plan, "cpu_has_native_bf16", lambda: native_bf16)
    assert memory_plan.serving_dtype(RuntimeConfig(dtype="auto"), str(tmp_path)) is expected
    explicit = RuntimeConfig(dtype="float32")
    assert memory_plan.serving_dtype(explicit, str(tmp_path)) is torch.float32


def test_capability_agrees_with_the_cpu_flags():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = cpuinfo.read_text().split()
    assert cpu_has_native_bf16() == ("amx_bf16" in flags or "avx512_bf16" in flags)
