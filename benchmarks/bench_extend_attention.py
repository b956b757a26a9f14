"""Prefill attention on CPU in bfloat16: the native backend's kernel
(`csrc/extend_attention.cpp`: AMX tiles, or AVX512-BF16 dot products on CPUs without AMX)
against torch's CPU flash attention (SDPA), the path it replaces.

Two levels, each side alternating with the other (`harness.alternate`, best of the rounds):
- one attention layer of SmolLM2-135M's shape (9 query heads, 3 kv heads, head size 64):
  2 fresh prompts of 1024 tokens (causal SDPA over the new keys), and 32 prompts of 32 new
  tokens after a 512-token cached prefix (SDPA over keys gathered from the pool with a mask,
  as the torch backend runs it);
- a whole engine (`dtype="auto"`, the instruct model): the bench_cpu prefill (2 x 1024
  tokens) and shared-prefix workloads, the same engine switching its prefill attention
  between the two paths.
The kernel is the one the engine picks here (AMX where it runs, else AVX512-BF16); each
kind of machine writes a table of its own (`extend_attention` on AMX,
`extend_attention_avx512_bf16` elsewhere).

    .venv/bin/python benchmarks/bench_extend_attention.py [--repeats 8]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from harness import Phase


def layer_cases(ops: Any, amx: bool) -> dict[str, dict[str, Callable[[], Any]]]:
    heads, kv_heads, dim = 9, 3, 64
    scale = dim**-0.5
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for label, prefix, new, reqs in (
        ("2 x 1024 fresh tokens", 0, 1024, 2),
        ("32 x 32 new tokens after a 512-token prefix", 512, 32, 32),
    ):
        keys = prefix + new
        slots = reqs * keys + 1
        k_buf = torch.randn(slots, kv_heads, dim, generator=gen).bfloat16()
        v_buf = torch.randn(slots, kv_heads, dim, generator=gen).bfloat16()
        table = (torch.arange(reqs * keys) + 1).reshape(reqs, keys)
        q = torch.randn(reqs * new, heads, dim, generator=gen).bfloat16()
        meta = (
            torch.arange(reqs),
            torch.full((reqs,), prefix),
            torch.full((reqs,), new),
            torch.arange(reqs) * new,
        )
        qs = q.view(reqs, new, heads, dim).transpose(1, 2)

        def native(q=q, k_buf=k_buf, v_buf=v_buf, table=table, meta=meta):
            return ops.extend_attention(q, k_buf, v_buf, table, *meta, scale, 0, amx)

        if prefix == 0:
            ks = k_buf[1:].view(reqs, keys, kv_heads, dim).transpose(1, 2)
            vs = v_buf[1:].view(reqs, keys, kv_heads, dim).transpose(1, 2)

            def sdpa(qs=qs, ks=ks, vs=vs):
                return F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
                )
        else:
            pos = prefix + torch.arange(new)
            allowed = torch.arange(keys)[None, :] <= pos[:, None]
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")).bfloat16()
            index = table.reshape(-1)

            def sdpa(qs=qs, index=index, mask=mask, k_buf=k_buf, v_buf=v_buf, reqs=reqs, keys=keys):
                shape = (reqs, keys, kv_heads, dim)
                ks = k_buf.index_select(0, index).view(shape).transpose(1, 2)
                vs = v_buf.index_select(0, index).view(shape).transpose(1, 2)
                return F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
                )

        cases[label] = {"native kernel": native, "torch SDPA": sdpa}
    return cases


def engine_cases(engine: Any) -> dict[str, tuple[list[list[int]], int]]:
    ids = engine.tokenizer(" ".join(f"word{i} and more text number {i}." for i in range(4000)))
    ids = ids.input_ids
    shared = []
    for g in range(4):
        system = ids[1000 + g * 600 : 1000 + g * 600 + 512]
        shared += [system + ids[5000 + 40 * (8 * g + i) :][:32] for i in range(8)]
    return {
        "engine: prefill 2 x 1024": ([ids[10000:11024], ids[12000:13024]], 1),
        "engine: shared prefix 32 prompts, 16 new": (shared, 16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=8)
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args()

    from lmprog_runtime import Engine
    from lmprog_runtime.attention.native_backend import _preferred_extend_kernel
    from lmprog_runtime.native import load_native

    ops = load_native()
    kernel = _preferred_extend_kernel(ops)
    if kernel is None:
        raise SystemExit("no native extend attention on this machine: nothing to compare")
    rows = []
    for label, fns in layer_cases(ops, kernel == "amx").items():
        native, sdpa = (Phase(name, fn) for name, fn in fns.items())
        harness.alternate([native, sdpa], args.repeats * 3)
        rows.append(_row(f"one layer: {label}", native.best, sdpa.best, kernel))
    engine = Engine(harness.resolve_model(args.model), dtype="auto", max_total_tokens=8192)
    harness.warm_engine(engine)
    attention = engine.runner.attention
    assert attention._extend_kernel == kernel, "the engine does not use the native kernel"
    for label, (prompts, new) in engine_cases(engine).items():
        params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}

        def generate(prompts=prompts, params=params) -> None:
            engine.generate(input_ids=prompts, sampling_params=params)

        def switch(use: str | None) -> None:  # untimed, before each run
            attention._extend_kernel = use
            harness.flush(engine)

        native = Phase("native kernel", generate, before=lambda: switch(kernel))
        sdpa = Phase("torch SDPA", generate, before=lambda: switch(None))
        harness.alternate([native, sdpa], args.repeats)
        rows.append(_row(label, native.best, sdpa.best, kernel))
    attention._extend_kernel = kernel
    engine.shutdown()
    args.dtype = "bfloat16"
    harness.write_result(
        args,
        "extend_attention" if kernel == "amx" else f"extend_attention_{kernel}",
        {
            "title": f"Prefill attention on CPU: {KERNEL_NAMES[kernel]} vs torch SDPA (bfloat16)",
            "workload": (
                "one attention layer of SmolLM2-135M's shape, and whole engine runs with the "
                f"prefill attention switched; sides alternating, best of {args.repeats} rounds "
                f"({args.repeats * 3} for one layer)"
            ),
            "columns": list(rows[0]),
            "rows": rows,
        },
    )


KERNEL_NAMES = {"amx": "AMX kernel", "avx512_bf16": "AVX512-BF16 kernel"}


def _row(label: str, native: float, sdpa: float, kernel: str) -> dict[str, str]:
    return {
        "case": label,
        f"{KERNEL_NAMES[kernel]} (ms)": f"{native * 1e3:.1f}",
        "torch SDPA (ms)": f"{sdpa * 1e3:.1f}",
        "speedup": f"{sdpa / native:.2f}x",
    }


if __name__ == "__main__":
    main()
