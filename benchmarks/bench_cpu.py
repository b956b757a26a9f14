"""CPU speed side by side (issue 17): lmprog in float32, `dtype="auto"`, int8 and int4
weights, against transformers `generate` (bfloat16 and float32) and, when
llama-cpp-python is installed, llama.cpp on the same GGUF.

Workloads, all greedy with the output length fixed (EOS masked):
- one stream: a 32-token prompt, 128 new tokens;
- shared prefix: 4 groups x 8 prompts (a 512-token system prompt per group + 32 tokens of
  their own), 16 new tokens each (llama.cpp runs them one at a time: in arrival order from
  an empty context each, and sorted, reusing the previous prompt's KV prefix);
- prefill: 2 x 1024 fresh tokens, 1 new token, as a share of this machine's bfloat16
  matmul peak measured in the same run (2 x non-embedding parameters x tokens FLOPs).
Every side is built and warmed first; rounds alternate (ABBA), best and median reported.

    .venv/bin/python benchmarks/bench_cpu.py [--model smollm2-135m-instruct] [--repeats 2]

llama.cpp (optional): build llama-cpp-python from source with GGML_NATIVE=OFF and explicit
flags (a native build crashed with an illegal instruction on a machine whose CPU flags
promise more than its OS enables); the figures in the README came from

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
      .venv/bin/pip install --no-deps llama-cpp-python==0.3.36
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any

import harness
import torch
from harness import Phase

SIDES = {  # name -> Engine options
    "lmprog float32": {"dtype": "float32"},
    "lmprog auto dtype": {"dtype": "auto"},
    "lmprog int8": {"dtype": "auto", "quantization": "int8"},
    "lmprog int4": {"dtype": "auto", "quantization": "int4"},
}


def bf16_peak_gflops(repeats: int = 10) -> float:
    """torch's best bfloat16 matmul rate on this machine (GFLOP/s): the fastest of several
    shapes (square ones and the shapes of a prefill), each warmed up, best of `repeats`."""
    best_rate = 0.0
    for m, k, n in ((2048, 2048, 2048), (4096, 4096, 4096), (2048, 576, 3072), (2048, 1536, 576)):
        a = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(k, n, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best_rate = max(best_rate, 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return best_rate


def workloads(tokenizer: Any) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts as token ids, new tokens per prompt)."""
    corpus = " ".join(f"word{i} and more text number {i}." for i in range(4000))
    ids = tokenizer(corpus).input_ids
    single = [ids[:32]]
    shared = []
    for g in range(4):
        system = ids[1000 + g * 600 : 1000 + g * 600 + 512]
        shared += [system + ids[5000 + 40 * (8 * g + i) :][:32] for i in range(8)]
    prefill = [ids[10000:11024], ids[12000:13024]]
    return {"one stream": (single, 128), "shared prefix": (shared, 16), "prefill": (prefill, 1)}


def engine_phase(name: str, engine: Any, prompts: list[list[int]], new: int) -> Phase:
    params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}

    def run() -> list[list[int]]:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]

    return Phase(name, run, before=lambda: harness.flush(engine))


def llama_cpp_phase(llm: Any, prompts: list[list[int]], new: int, reuse: bool) -> Phase:
    """llama.cpp runs one prompt at a time. Without `reuse` every prompt starts from an
    empty context (arrival order, nothing shared); with it the prompts go sorted, so each
    starts from the KV of the previous one and evaluates only what differs (llama-cpp-python
    keeps the longest common prefix of consecutive prompts)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i]) if reuse else range(len(prompts))

    def run() -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in prompts]
        llm.reset()
        for i in order:
            if not reuse:
                llm.reset()
            tokens = outs[i]
            for token in llm.generate(prompts[i], temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == new:
                    break
        return outs

    name = "llama.cpp, sorted by prefix" if reuse else "llama.cpp, one by one"
    return Phase(f"{name} (llama-cpp-python)", run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=2)
    parser.set_defaults(model="smollm2-135m-instruct")
    parser.add_argument("--skip", default="", help="comma-separated side names to leave out")
    args = parser.parse_args()

    from lmprog_runtime import Engine, resolve_model_path
    from lmprog_runtime.models.cpu import cpu_has_native_bf16

    path = harness.resolve_model(args.model)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    engines = {
        name: Engine(path, max_total_tokens=8192, **options)
        for name, options in SIDES.items()
        if name not in skip
    }
    tokenizer = next(iter(engines.values())).tokenizer
    hf = {dtype: harness.load_hf_model(path, dtype) for dtype in ("bfloat16", "float32")}
    for engine in engines.values():
        harness.warm_engine(engine)
    for model in hf.values():
        harness.warm_hf(model, tokenizer)
    peak = bf16_peak_gflops()  # measured again at the end: the higher one counts
    # Prefill FLOPs: 2 x the weights every token multiplies (not embeddings; the LM head
    # runs for the last token only).
    params = sum(
        p.numel()
        for n, p in hf["float32"].named_parameters()
        if "embed" not in n and "lm_head" not in n
    )
    gguf = resolve_model_path(args.model)
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None and gguf.endswith(".gguf")
    llm = None
    if has_llama_cpp:
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    rows, raw = [], {}
    for workload, (prompts, new) in workloads(tokenizer).items():
        phases = [engine_phase(name, e, prompts, new) for name, e in engines.items()]
        phases += [
            Phase(
                f"transformers generate {dtype}",
                lambda m=model, p=prompts, n=new: harness.hf_generate(m, p, n, 8),
            )
            for dtype, model in hf.items()
        ]
        if llm is not None:
            phases.append(llama_cpp_phase(llm, prompts, new, reuse=False))
            if workload == "shared prefix":
                phases.append(llama_cpp_phase(llm, prompts, new, reuse=True))
        print(f"{workload}: {len(prompts)} prompts, {new} new tokens", flush=True)
        harness.alternate(phases, args.repeats)
        # The baseline: llama.cpp (sorted by prefix on the shared-prefix workload, where it
        # reuses KV; one by one elsewhere), or transformers in float32 without it.
        base = phases[-1]
        base_label = "llama.cpp" if llm is not None else base.name
        reference = next(p for p in phases if p.name == "lmprog float32").values[-1]
        tokens = sum(len(p) for p in prompts) if workload == "prefill" else len(prompts) * new
        for phase in phases:
            row = {
                "workload": workload,
                "system": phase.name,
                "best / median (s)": f"{phase.best:.2f} / {phase.median:.2f}",
                f"vs {base_label} (best / median)": harness.speedup(base, phase),
                "greedy tokens = lmprog float32": _agreement(phase.values[-1], reference),
            }
            if workload == "prefill":
                row["_seconds"] = row["best / median (s)"]
                row["_gflops"] = 2 * params * tokens / phase.best / 1e9
            rows.append(row)
        raw[workload] = {p.name: p.timing() for p in phases}
    peak = max(peak, bf16_peak_gflops())
    for row in rows:  # the prefill rows' share of the peak, now that it is known
        if row["workload"] == "prefill":
            seconds, gflops = row.pop("_seconds"), row.pop("_gflops")
            row["best / median (s)"] = f"{seconds} ({gflops / peak:.0%} of bf16 peak)"
    for engine in engines.values():
        engine.shutdown()
    args.dtype = "per row: float32, auto (bfloat16 here), int8 / int4 with bfloat16 activations"
    if not cpu_has_native_bf16():
        args.dtype = "per row: float32 (auto and the quantized engines too: no native bfloat16)"
    harness.write_result(
        args,
        "cpu",
        {
            "title": "CPU speed: lmprog dtypes and quantization against transformers"
            + (" and llama.cpp" if has_llama_cpp else ""),
            "workload": (
                "one stream (32-token prompt, 128 new tokens); 4 groups x 8 prompts with a "
                "512-token shared system prompt + 32 tokens, 16 new each; prefill of 2 x "
                f"1024 fresh tokens. bfloat16 matmul peak measured here: {peak:.0f} GFLOP/s. "
                f"{args.repeats} rounds, alternating order"
            ),
            "columns": list(rows[0]),
            "rows": rows,
            "raw": raw,
        },
    )


def _agreement(ours: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y))
    total = sum(len(y) for y in reference)
    return f"{same}/{total}"


if __name__ == "__main__":
    main()
