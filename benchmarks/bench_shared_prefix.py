"""Shared-prefix throughput: the Engine with the radix cache, without it, and transformers.

Workload (issue 3): 8 groups x 16 prompts; each group has its own 1024-token system prompt,
each prompt its own 64-token question; exactly 32 greedy output tokens each (EOS masked by
`min_new_tokens` on every side); all 128 prompts shuffled and submitted at once; float32.
transformers runs at batch 16, 32, 64 and 128 in the first round and its best batch size
in the others; rounds alternate their order, each engine's cache is flushed before each of
its phases, and the outputs of all three are compared token by token.

    .venv/bin/python benchmarks/bench_shared_prefix.py [--model small] [--groups 8]
"""

from __future__ import annotations

import argparse
import random

import harness
import torch
from harness import Phase


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        # Above the low ids where tokenizers keep their special tokens.
        return torch.randint(32, vocab, (n,), generator=gen).tolist()

    prompts = []
    for _ in range(args.groups):
        system = ids(args.system_len)
        prompts.extend(system + ids(args.question_len) for _ in range(args.per_group))
    random.Random(0).shuffle(prompts)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hf-batch-sizes", default="16,32,64,128")
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    args = parser.parse_args()

    from lmprog_runtime import Engine

    path = harness.resolve_model(args.model)
    config = {
        "dtype": args.dtype,
        "max_total_tokens": args.max_total_tokens,
        "max_running_requests": args.groups * args.per_group,
    }
    cached = Engine(path, **config)
    plain = Engine(path, disable_radix_cache=True, **config)
    hf = harness.load_hf_model(path, args.dtype)
    vocab = min(cached.runner.model_config.vocab_size, len(cached.tokenizer))
    prompts = make_prompts(args, vocab)
    total_out = len(prompts) * args.new_tokens
    n = args.new_tokens
    params = {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0}
    for engine in (cached, plain):
        harness.warm_engine(engine)
    harness.warm_hf(hf, cached.tokenizer)
    print(f"model={path} {args.groups}x{args.per_group} prompts of {len(prompts[0])} tokens")

    def engine_phase(name: str, engine: Engine) -> Phase:
        def run() -> tuple[list[list[int]], dict[str, float]]:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            return [o["output_ids"] for o in outs], engine.stats()

        return Phase(name, run, before=lambda: harness.flush(engine))

    on, off = engine_phase("engine, cache on", cached), engine_phase("engine, cache off", plain)
    hf_phases = {
        bs: Phase(f"transformers batch {bs}", lambda bs=bs: harness.hf_generate(hf, prompts, n, bs))
        for bs in (int(b) for b in args.hf_batch_sizes.split(","))
    }
    # One round over every batch size picks the baseline; the remaining rounds time only it.
    harness.alternate([on, off, *hf_phases.values()], 1)
    best_bs = min(hf_phases, key=lambda bs: hf_phases[bs].best)
    base = hf_phases[best_bs]
    harness.alternate([on, off, base], args.repeats - 1, first_round=1)

    on_ids, stats = on.values[-1]
    off_ids = off.values[-1][0]
    same_cache = harness.compare_tokens(on_ids, off_ids)
    vs_hf = harness.compare_tokens(on_ids, base.values[-1])
    vs_hf_off = harness.compare_tokens(off_ids, base.values[-1])
    hit_rate = stats["cached_tokens"] / (stats["prefill_tokens"] + stats["cached_tokens"])
    dtypes = {"engine": harness.param_dtype(cached.runner.model), "hf": harness.param_dtype(hf)}
    for engine in (cached, plain):
        engine.shutdown()

    def row(system: str, phase: Phase, outputs: str) -> dict[str, str]:
        return harness.throughput_row(system, phase, base, total_out, outputs)

    to_hf = "prompts token-identical to transformers"
    harness.write_result(
        args,
        "shared_prefix",
        {
            "title": "Shared-prefix workload",
            "workload": (
                f"{args.groups} groups x {args.per_group} prompts (a {args.system_len}-token "
                f"system prompt per group + a {args.question_len}-token question), exactly "
                f"{n} greedy new tokens each, shuffled and submitted at once; transformers at "
                f"batch {args.hf_batch_sizes} in round 1, its best batch size in the other "
                f"{args.repeats - 1} round(s); rounds in alternating order, both engines warmed on "
                "another prompt and flushed before each phase"
            ),
            "columns": harness.THROUGHPUT_COLUMNS,
            "rows": [
                row(f"transformers generate (batch {best_bs})", base, "reference"),
                row(
                    "lmprog Engine, radix cache off",
                    off,
                    harness.describe_match(vs_hf_off, to_hf),
                ),
                row(
                    "lmprog Engine, radix cache on",
                    on,
                    harness.describe_match(vs_hf, to_hf)
                    + "; "
                    + harness.describe_match(same_cache, "equal to cache off"),
                ),
            ],
            "notes": [
                f"Cache hit rate: {hit_rate:.1%} of prompt tokens "
                f"({int(stats['prefill_tokens']):,} computed, {int(stats['cached_tokens']):,} "
                f"reused); {int(stats['forward_passes'])} forwards with the cache on."
            ],
            "param_dtypes": dtypes,
            "timings": {p.name: p.timing() for p in [on, off, *hf_phases.values()]},
            "token_match": {"on_vs_off": same_cache, "on_vs_hf": vs_hf, "off_vs_hf": vs_hf_off},
            "engine_stats": stats,
        },
    )


if __name__ == "__main__":
    main()
