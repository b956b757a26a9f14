"""Output throughput of the Engine against transformers' batched `generate`, in one run.

Workload: 64 distinct prompts of 256 tokens (windows of the shipped corpus), 64 new tokens
each (EOS ignored), on the built-in `small` model, float32 on CPU by default. transformers
runs at several batch sizes and the best one is the baseline. Also reports the share of
engine step time spent outside the model forward.

    .venv/bin/python benchmarks/bench_throughput.py [--num-prompts 64] [--hf-batch-sizes 16,32,64]
"""

from __future__ import annotations

import argparse
import time

import torch
from _baselines import hf_generate_seconds


def make_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    from pathlib import Path

    import lmprog_runtime

    corpus = Path(lmprog_runtime.__file__).parent / "data" / "corpus.txt"
    ids = tokenizer(corpus.read_text(encoding="utf-8")).input_ids
    stride = (len(ids) - prompt_len) // num_prompts
    return [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]


def run_engine(
    model_path: str, prompts: list[list[int]], new_tokens: int, backend: str
) -> tuple[float, dict]:
    from lmprog_runtime import Engine

    pool = len(prompts) * (len(prompts[0]) + new_tokens + 8)
    with Engine(
        model_path, max_total_tokens=pool, max_prefill_tokens=16384, attention_backend=backend
    ) as engine:
        engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 2})  # warm
        engine.reset_stats()
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        assert all(len(o["output_ids"]) == new_tokens for o in outs)
        stats = engine.stats()
    stats["wall_seconds"] = elapsed
    return elapsed, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16,32,64")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: built-in small)")
    parser.add_argument("--attention-backend", default="native", choices=["torch", "native"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lmprog_runtime import default_model_path

    model_path = args.model or default_model_path("small")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len)
    total_out = args.num_prompts * args.new_tokens
    print(
        f"model={model_path} threads={torch.get_num_threads()} prompts={args.num_prompts}x"
        f"{args.prompt_len} new_tokens={args.new_tokens}"
    )

    # Interleaved repeats, best of each: the machine is shared and noisy, and the first big
    # allocations of a process cost page faults that later runs do not pay.
    engine_s, stats = float("inf"), {}
    hf: dict[int, float] = {}
    for _ in range(args.repeats):
        seconds, run_stats = run_engine(
            model_path, prompts, args.new_tokens, args.attention_backend
        )
        print(f"  lmprog engine: {total_out / seconds:.1f} tok/s")
        if seconds < engine_s:
            engine_s, stats = seconds, run_stats
        for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
            seconds = hf_generate_seconds(model_path, prompts, args.new_tokens, bs)
            print(f"  transformers batch {bs}: {total_out / seconds:.1f} tok/s")
            hf[bs] = min(hf.get(bs, float("inf")), seconds)
    best_bs = min(hf, key=hf.get)
    outside_step = 1 - stats["forward_seconds"] / stats["step_seconds"]
    outside_wall = 1 - stats["forward_seconds"] / stats["wall_seconds"]

    print()
    print("| system | output tok/s | ratio |")
    print("|---|---|---|")
    print(f"| transformers generate (batch {best_bs}) | {total_out / hf[best_bs]:.1f} | 1.00x |")
    name = f"lmprog Engine ({args.attention_backend} attention)"
    print(f"| {name} | {total_out / engine_s:.1f} | {hf[best_bs] / engine_s:.2f}x |")
    print()
    print(
        f"engine: {int(stats['forward_passes'])} forwards, max batch "
        f"{int(stats['max_running_requests_seen'])}; time outside the model forward: "
        f"{outside_step:.1%} of step time, {outside_wall:.1%} of wall time"
    )


if __name__ == "__main__":
    main()
