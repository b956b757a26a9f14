"""The GPU check's kernel sections: the fused ops, the sampler's keyed race and top-p
search, the attention kernels' bfloat16 error and the decode kernel's bandwidth."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from gpu_check_common import (
    Check,
    SkipSection,
    time_cuda,
    timed,
)

# Nominal HBM bandwidth (bytes/s) by device name, for the bandwidth fraction: the first key
# the name holds (`nominal_peak`), so a card's variants come before its plain name.
HBM_PEAK = {
    "H200": 4.8e12,
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,  # the SXM card ("NVIDIA H100 80GB HBM3"), which the device tool lends
    "A100-SXM4-40GB": 1.555e12,
    "A100-PCIE-40GB": 1.555e12,
    "A100": 2.0e12,
    "L40S": 0.864e12,
}


def nominal_peak(device_name: str) -> float | None:
    """The nominal HBM bandwidth (bytes/s) of the GPU named `device_name`, if known.

    Example:
        >>> nominal_peak("NVIDIA H100 PCIe"), nominal_peak("NVIDIA H100 80GB HBM3")
        (2000000000000.0, 3350000000000.0)
    """
    return next((bw for key, bw in HBM_PEAK.items() if key in device_name), None)


def fused_ops(check: Check) -> dict[str, Any]:
    """The Triton RMSNorm / SiLU-and-mul / RoPE against the torch reference, bfloat16."""
    if check.device != "cuda":
        raise SkipSection("needs CUDA (tests/kernels/test_triton_ops.py runs them on a CPU)")
    from lmprog_runtime.models.ops import TorchOps
    from lmprog_runtime.models.triton_ops import TritonOps

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, residual, weight = randn(37, 576), randn(37, 576), randn(576)
    q, k = randn(37, 9, 64), randn(37, 3, 64)
    positions = torch.randint(0, 512, (37,), generator=gen, device="cuda")
    angles = torch.rand(512, 32, generator=gen, device="cuda") * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = TorchOps.rope(q, k, positions, cos, sin)
    got_q, got_k = TritonOps.rope(q.clone(), k.clone(), positions, cos, sin)
    pairs = {
        "rms_norm": (TritonOps.rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6)),
        "add_rms_norm": (
            TritonOps().add_rms_norm(x, residual.clone(), weight, 1e-6)[0],
            TorchOps().add_rms_norm(x, residual, weight, 1e-6)[0],
        ),
        "silu_and_mul": (TritonOps.silu_and_mul(x), TorchOps.silu_and_mul(x)),
        "rope_q": (got_q, ref_q),
        "rope_k": (got_k, ref_k),
    }
    return {
        name: {"max_abs_diff": float((a.float() - b.float()).abs().max())}
        for name, (a, b) in pairs.items()
    }


def keyed_race(check: Check) -> dict[str, Any]:
    """The sampler's draw on the GPU (`keyed_race.py`): the Triton race against its torch
    ops (the same tokens), and the time of a batch-64 draw over a SmolLM2-sized vocabulary,
    host included: the kernel, the torch ops, and a generator per row (`exponential_` per
    row, what the sampler did before). The smoke run checks it on a CPU (Triton only under
    `TRITON_INTERPRET=1`), tiny sizes."""
    from lmprog_runtime.keyed_race import key_words, keyed_exponentials, race_key

    device = check.device
    rows, vocab, iters = (4, 300, 2) if check.smoke else (64, 49152, 50)
    gen = torch.Generator(device=device).manual_seed(0)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen, device=device), dim=-1)
    keys = [race_key(seed, 5) for seed in range(rows)]
    words = key_words(keys, device)

    def torch_ops() -> torch.Tensor:
        return (probs / keyed_exponentials(words, vocab)).argmax(dim=-1)

    generators = [torch.Generator(device=device).manual_seed(seed) for seed in range(rows)]

    def per_row() -> torch.Tensor:
        noise = torch.empty_like(probs)
        for row, generator in zip(noise, generators):
            row.exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        return 1e3 * timed(lambda: [fn() for _ in range(iters)]) / iters

    out: dict[str, Any] = {"rows": rows, "vocab": vocab}
    out["ms_torch_ops"] = wall(torch_ops)
    out["ms_generator_per_row"] = wall(per_row)
    # Top-p (0.9) as the sampler runs it on a GPU (the floor search: no sort, nothing read
    # back), with whole rows sorted instead, and as on a CPU (a 256-token window, then a
    # read-back of the rows it missed); and whether the search keeps the sorted tokens.
    from lmprog_runtime.sampling_filters import top_k_top_p, top_k_top_p_unsorted

    top_k = torch.full((rows,), vocab, device=device)
    top_p = torch.full((rows,), 0.9, device=device)
    out["ms_top_p_floor_search"] = wall(lambda: top_k_top_p_unsorted(probs, top_k, top_p, 0))
    for name, full in (("ms_top_p_full_sort", True), ("ms_top_p_window_and_read_back", False)):
        out[name] = wall(lambda full=full: top_k_top_p(probs, top_k, top_p, 0, full=full))
    searched = top_k_top_p_unsorted(probs, top_k, top_p, 0) > 0
    sorted_kept = top_k_top_p(probs, top_k, top_p, 0, full=True) > 0
    same = int((searched == sorted_kept).all(dim=-1).sum())
    out["top_p_rows_keeping_the_sorted_tokens"] = f"{same}/{rows}"
    has_triton = importlib.util.find_spec("triton") is not None
    if not has_triton or (device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"):
        out["triton"] = "skipped: needs Triton (on a CPU, under TRITON_INTERPRET=1)"
        return out
    from lmprog_runtime.triton_race import race

    out["rows_equal_to_torch_ops"] = f"{int((race(probs, words) == torch_ops()).sum())}/{rows}"
    out["ms_triton"] = wall(lambda: race(probs, key_words(keys, device)))
    return out


def attention_error(check: Check) -> dict[str, Any]:
    """The attention kernels alone in bfloat16 (Triton decode and extend, torch's SDPA)
    against a float32 reference on the same bfloat16 inputs."""
    if check.device != "cuda":
        raise SkipSection("needs CUDA")
    return _attention_kernel_error()


def _attention_kernel_error() -> dict[str, Any]:
    """Max and mean absolute error of each attention output against float32 SDPA on the
    same bfloat16 inputs, at the built-in models' layouts and llama-3-8b's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {}
    for heads, kv_heads, dim in ((4, 2, 16), (8, 4, 64), (32, 8, 128)):
        for key, errors in _layout_error(gen, heads, kv_heads, dim).items():
            out[f"h{heads}_kv{kv_heads}_d{dim}/{key}"] = errors
    return out


def _layout_error(gen: torch.Generator, heads: int, kv_heads: int, dim: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from lmprog_runtime.attention import triton_decode as td
    from lmprog_runtime.attention import triton_kernels as tk

    batch, seq, new = 8, 512, 64
    slots = batch * seq

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    kb, vb = randn(slots + 1, kv_heads, dim), randn(slots + 1, kv_heads, dim)
    table = (torch.randperm(slots, generator=gen, device="cuda") + 1).view(batch, seq)
    rows = torch.arange(batch, device="cuda")
    keys, values = kb[table].transpose(1, 2), vb[table].transpose(1, 2)  # [b, kv, s, d]
    scale = dim**-0.5

    def sdpa(q4: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        k4, v4 = (keys, values) if q4.dtype == torch.bfloat16 else (keys.float(), values.float())
        return F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True
        )

    # (queries scaled up: peaked attention, where rounding the probabilities matters most)
    q = randn(batch, heads, dim, scale=3.0)
    lens = torch.full((batch,), seq, dtype=torch.int64, device="cuda")
    splits = td.choose_num_splits(batch, kv_heads, seq, q.device)
    decode = {
        "triton": td.decode_attention(q, kb, vb, table, rows, lens, scale, 0, splits),
        "sdpa_bf16": sdpa(q[:, :, None])[:, :, 0],
    }
    qe = randn(batch * new, heads, dim, scale=3.0)
    prefix = torch.full((batch,), seq - new, dtype=torch.int64, device="cuda")
    ext = torch.full((batch,), new, dtype=torch.int64, device="cuda")
    starts = torch.arange(batch, device="cuda") * new
    positions = seq - new + torch.arange(new, device="cuda")
    causal = torch.arange(seq, device="cuda")[None] <= positions[:, None]
    qb = qe.view(batch, new, heads, dim).transpose(1, 2)
    triton_extend = tk.extend_attention(qe, kb, vb, table, rows, prefix, ext, starts, new, scale)
    extend = {
        "triton": triton_extend.view(batch, new, heads, dim).transpose(1, 2),
        "sdpa_bf16": sdpa(qb, causal),
    }
    out: dict[str, Any] = {}
    references = {
        "decode": sdpa(q[:, :, None].float())[:, :, 0],
        "extend": sdpa(qb.float(), causal),
    }
    for kind, outputs in (("decode", decode), ("extend", extend)):
        for label, got in outputs.items():
            err = (got.float() - references[kind]).abs()
            out[f"{kind}/{label}"] = {
                "max_abs_err": float(err.max()),
                "mean_abs_err": float(err.mean()),
            }
    return out


def decode_bandwidth(check: Check) -> dict[str, Any]:
    if check.device != "cuda":
        raise SkipSection("needs CUDA")
    from lmprog_runtime.attention import triton_decode as td

    copy_bytes = 2 << 30
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = time_cuda(functools.partial(dst.copy_, src))
    measured_peak = 2 * copy_bytes / copy_s  # read + written
    nominal = nominal_peak(torch.cuda.get_device_name())
    out: dict[str, Any] = {
        "copy_bandwidth_gbs": measured_peak / 1e9,
        "nominal_peak_gbs": (nominal or 0) / 1e9,
    }
    # (24 and 48: graph buckets whose split count the waves' fill raised, 2 -> 4, 1 -> 2)
    for batch, seq_len in ((64, 4096), (8, 16384), (256, 1024), (24, 4096), (48, 4096)):
        heads, kv_heads, head_dim = 32, 8, 128
        slots = batch * seq_len
        k = torch.randn(slots + 1, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = (torch.randperm(slots, device="cuda") + 1).view(batch, seq_len)
        rows = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), seq_len, dtype=torch.int64, device="cuda")
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        splits = td.choose_num_splits(batch, kv_heads, seq_len, q.device)
        moved = 2 * slots * kv_heads * head_dim * 2 + slots * 8  # K, V (bf16) and the table
        attend = functools.partial(  # (the split count last)
            td.decode_attention, q, k, v, table, rows, lens, head_dim**-0.5, 0
        )
        # The chosen count (`choose_num_splits`: the fill of the programs' waves), and the
        # counts around it timed in the same run, to tell whether it is the fastest (the
        # rule before chose 5 at batch 8, 2 at 24 and 1 at 48).
        by_splits = {
            n: moved / time_cuda(functools.partial(attend, n)) / 1e9
            for n in sorted({1, 2, 4, 5, 8, 16, splits})
            if n <= td.MAX_DECODE_SPLITS and (n - 1) * td.MIN_SPLIT_LEN < seq_len
        }
        seconds = moved / by_splits[splits] / 1e9
        entry = {"microseconds": seconds * 1e6, "gbs": by_splits[splits], "num_splits": splits}
        entry["gbs_by_splits"] = {n: round(value, 1) for n, value in by_splits.items()}
        entry["fraction_of_copy_bandwidth"] = moved / seconds / measured_peak
        if nominal:
            entry["fraction_of_nominal_peak"] = moved / seconds / nominal
        out[f"b{batch}_s{seq_len}"] = entry
    return out
