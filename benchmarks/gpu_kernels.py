"""GPU check of the Triton kernels: correctness against the torch reference, then timings
against torch's scaled_dot_product_attention on equal work, with the decode kernel's
achieved memory bandwidth. Prepared for a lent GPU (one run, a few minutes):

    .venv/bin/python benchmarks/gpu_kernels.py            # needs CUDA

Record the printed table and the date in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def bench(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    from lmprog_runtime.attention import triton_decode as td
    from lmprog_runtime.attention import triton_kernels as tk

    assert torch.cuda.is_available(), "this script needs a CUDA device"
    print(f"device={torch.cuda.get_device_name()} dtype=bfloat16")
    print("| case | triton (ms) | torch SDPA (ms) | ratio | decode GB/s | max abs err |")
    print("|---|---|---|---|---|---|")
    for case in [(64, 1024, 32, 8, 128), (256, 2048, 32, 8, 128)]:
        run_case(tk, td, *case)


def run_case(tk, td, batch: int, seq: int, heads: int, kv_heads: int, dim: int) -> None:
    dev, dtype = "cuda", torch.bfloat16
    slots = batch * seq
    kb = torch.randn(slots + 1, kv_heads, dim, device=dev, dtype=dtype)
    vb = torch.randn_like(kb)
    table = (torch.randperm(slots, device=dev) + 1).view(batch, seq).to(torch.int64)
    rows = torch.arange(batch, device=dev)
    lens = torch.full((batch,), seq, device=dev, dtype=torch.int64)
    q = torch.randn(batch, heads, dim, device=dev, dtype=dtype)
    scale = dim**-0.5
    ours = lambda: td.decode_attention(q, kb, vb, table, rows, lens, scale, 0, 8)  # noqa: E731
    keys = kb[table].transpose(1, 2)  # gathered once: SDPA gets contiguous K/V
    values = vb[table].transpose(1, 2)
    ref = lambda: F.scaled_dot_product_attention(  # noqa: E731
        q[:, :, None], keys, values, scale=scale, enable_gqa=True
    )
    err = (ours().float() - ref()[:, :, 0].float()).abs().max().item()
    t_ours, t_ref = bench(ours), bench(ref)
    gbs = 2 * slots * kv_heads * dim * kb.element_size() / t_ours / 1e9
    print(
        f"| decode b{batch} s{seq} | {t_ours * 1e3:.3f} | {t_ref * 1e3:.3f} | "
        f"{t_ref / t_ours:.2f}x | {gbs:.0f} | {err:.3g} |"
    )

    new = 256
    qe = torch.randn(batch * new, heads, dim, device=dev, dtype=dtype)
    prefix = torch.full((batch,), seq - new, device=dev, dtype=torch.int64)
    ext = torch.full((batch,), new, device=dev, dtype=torch.int64)
    starts = torch.arange(batch, device=dev, dtype=torch.int64) * new
    ours_e = lambda: tk.extend_attention(qe, kb, vb, table, rows, prefix, ext, starts, new, scale)  # noqa: E731
    mask = (
        torch.arange(seq, device=dev)[None, :]
        <= (seq - new + torch.arange(new, device=dev))[:, None]
    )
    qb = qe.view(batch, new, heads, dim).transpose(1, 2)

    def ref_e():
        return F.scaled_dot_product_attention(
            qb, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )

    err = (
        (ours_e().view(batch, new, heads, dim).transpose(1, 2).float() - ref_e().float())
        .abs()
        .max()
        .item()
    )
    t_ours, t_ref = bench(ours_e, 10), bench(ref_e, 10)
    print(
        f"| extend b{batch} s{seq} new{new} | {t_ours * 1e3:.3f} | {t_ref * 1e3:.3f} | "
        f"{t_ref / t_ours:.2f}x | - | {err:.3g} |"
    )


if __name__ == "__main__":
    main()
