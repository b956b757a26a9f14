"""Output throughput of the Engine against transformers' batched `generate`, equal work.

Workload (issue 2): 64 distinct prompts of 256 tokens (windows of the shipped corpus),
exactly 64 greedy new tokens each (EOS masked by `min_new_tokens` on both sides), float32.
Both sides load once and warm up on another prompt outside the timed region; rounds run in
alternating order with the engine's cache flushed before each; transformers runs at every
listed batch size and its best is the baseline. The engine's tokens are compared with
transformers' (small float differences can flip a late token: reported, never hidden).

    .venv/bin/python benchmarks/bench_throughput.py [--model small] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import harness
from harness import Phase


def make_prompts(tokenizer: Any, num_prompts: int, prompt_len: int) -> list[list[int]]:
    import lmprog_runtime

    corpus = Path(lmprog_runtime.__file__).parent / "data" / "corpus.txt"
    ids = tokenizer(corpus.read_text(encoding="utf-8")).input_ids
    stride = (len(ids) - prompt_len) // num_prompts
    if stride < 1:
        raise ValueError(f"the corpus has only {len(ids)} tokens for this tokenizer")
    return [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16,32,64")
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()

    from lmprog_runtime import Engine

    path = harness.resolve_model(args.model)
    pool = args.num_prompts * (args.prompt_len + args.new_tokens + 8)
    engine = Engine(
        path,
        dtype=args.dtype,
        max_total_tokens=pool,
        max_prefill_tokens=16384,
        attention_backend=args.attention_backend,
    )
    hf = harness.load_hf_model(path, args.dtype)
    prompts = make_prompts(engine.tokenizer, args.num_prompts, args.prompt_len)
    total_out = args.num_prompts * args.new_tokens
    params = {
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
        "temperature": 0,
    }
    harness.warm_engine(engine)
    harness.warm_hf(hf, engine.tokenizer)
    print(f"model={path} prompts={args.num_prompts}x{args.prompt_len} new={args.new_tokens}")

    def run_engine() -> tuple[list[list[int]], dict[str, float]]:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [o["output_ids"] for o in outs], engine.stats()

    eng = Phase("lmprog engine", run_engine, before=lambda: harness.flush(engine))
    hf_phases = {
        bs: Phase(
            f"transformers batch {bs}",
            lambda bs=bs: harness.hf_generate(hf, prompts, args.new_tokens, bs),
        )
        for bs in (int(b) for b in args.hf_batch_sizes.split(","))
    }
    harness.alternate([eng, *hf_phases.values()], args.repeats)
    best_bs = min(hf_phases, key=lambda bs: hf_phases[bs].best)
    base = hf_phases[best_bs]
    engine_ids, stats = eng.values[-1]
    assert all(len(ids) == args.new_tokens for ids in engine_ids)
    cmp = harness.compare_tokens(engine_ids, base.values[-1])
    stable = all(v[0] == engine_ids for v in eng.values)
    outside = 1 - stats["forward_seconds"] / stats["step_seconds"]
    backend = engine.runner.attention_backend
    dtypes = {"engine": harness.param_dtype(engine.runner.model), "hf": harness.param_dtype(hf)}
    engine.shutdown()

    def row(system: str, phase: Phase, outputs: str) -> dict[str, str]:
        return harness.throughput_row(system, phase, base, total_out, outputs)

    harness.write_result(
        args,
        "throughput",
        {
            "title": "Engine vs transformers generate",
            "workload": (
                f"{args.num_prompts} distinct prompts of {args.prompt_len} tokens, exactly "
                f"{args.new_tokens} greedy new tokens each (EOS masked by `min_new_tokens` on "
                f"both sides); transformers at batch {args.hf_batch_sizes} (best taken); "
                f"{args.repeats} rounds in alternating order, both sides warmed on another "
                "prompt, the engine's cache flushed before each round"
            ),
            "columns": harness.THROUGHPUT_COLUMNS,
            "rows": [
                row(f"transformers generate (batch {best_bs})", base, "reference"),
                row(
                    f"lmprog Engine ({backend} attention)",
                    eng,
                    harness.describe_match(cmp, "prompts token-identical to transformers"),
                ),
            ],
            "notes": [
                f"Time outside the model forward: {outside:.1%} of engine step time; "
                f"{int(stats['forward_passes'])} forwards, max batch "
                f"{int(stats['max_running_requests_seen'])}."
                + ("" if stable else " The engine's tokens changed between rounds.")
            ],
            "param_dtypes": dtypes,
            "timings": {p.name: p.timing() for p in [eng, *hf_phases.values()]},
            "token_match": cmp,
            "engine_stats": stats,
        },
    )


if __name__ == "__main__":
    main()
