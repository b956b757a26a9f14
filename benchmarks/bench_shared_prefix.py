"""Shared-prefix throughput: the Engine with the radix cache, without it, and transformers.

Workload (issue 3): 8 groups x 16 prompts; each group has its own 1024-token system prompt,
each prompt its own 64-token question; 32 output tokens each (EOS ignored); all 128 prompts
shuffled and submitted at once; the built-in `small` model, float32, CPU. Reports output
throughput side by side from one run, as ratios to transformers' batched `generate` (best
of the listed batch sizes), and the engine's cache hit rate.

    .venv/bin/python benchmarks/bench_shared_prefix.py [--groups 8 --per-group 16]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from _baselines import hf_generate_seconds


def make_prompts(args, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    prompts = []
    for _ in range(args.groups):
        system = ids(args.system_len)
        prompts.extend(system + ids(args.question_len) for _ in range(args.per_group))
    random.Random(0).shuffle(prompts)
    return prompts


def run_engine(model_path: str, prompts, new_tokens: int, **config) -> tuple[float, dict]:
    from lmprog_runtime import Engine

    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with Engine(model_path, max_total_tokens=65536, max_running_requests=128, **config) as engine:
        engine.generate(input_ids=[7, 8, 9], sampling_params={"max_new_tokens": 2})  # warm up
        engine.flush_cache()
        engine.reset_stats()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        assert all(len(o["output_ids"]) == new_tokens for o in outs)
        return elapsed, engine.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hf-batch-sizes", default="16,32")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: built-in small)")
    args = parser.parse_args()

    from lmprog_runtime import default_model_path
    from lmprog_runtime.models import ModelConfig

    model_path = args.model or default_model_path("small")
    prompts = make_prompts(args, ModelConfig.from_path(model_path).vocab_size)
    total_out = len(prompts) * args.new_tokens
    print(
        f"model={model_path} threads={torch.get_num_threads()} {args.groups} groups x "
        f"{args.per_group} prompts of {args.system_len}+{args.question_len} tokens, "
        f"{args.new_tokens} new tokens each"
    )

    cached_s, cached_stats = run_engine(model_path, prompts, args.new_tokens)
    print(f"  engine with radix cache: {total_out / cached_s:.1f} tok/s")
    plain_s, _ = run_engine(model_path, prompts, args.new_tokens, disable_radix_cache=True)
    print(f"  engine without cache: {total_out / plain_s:.1f} tok/s")
    hf = {}
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        hf[bs] = hf_generate_seconds(model_path, prompts, args.new_tokens, bs)
        print(f"  transformers batch {bs}: {total_out / hf[bs]:.1f} tok/s")
    best = min(hf, key=hf.get)
    prompt_tokens = cached_stats["prefill_tokens"] + cached_stats["cached_tokens"]
    hit_rate = cached_stats["cached_tokens"] / prompt_tokens

    print()
    print("| system | output tok/s | vs transformers |")
    print("|---|---|---|")
    print(f"| transformers generate (batch {best}) | {total_out / hf[best]:.1f} | 1.00x |")
    print(
        f"| lmprog Engine, radix cache off | {total_out / plain_s:.1f} | {hf[best] / plain_s:.2f}x |"
    )
    print(
        f"| lmprog Engine, radix cache on | {total_out / cached_s:.1f} | {hf[best] / cached_s:.2f}x |"
    )
    print()
    print(
        f"cache hit rate: {hit_rate:.1%} of prompt tokens "
        f"({int(cached_stats['prefill_tokens'])} computed, {int(cached_stats['cached_tokens'])} reused); "
        f"{int(cached_stats['forward_passes'])} forwards"
    )


if __name__ == "__main__":
    main()
