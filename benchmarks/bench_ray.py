"""Prefix-affinity routing against random routing on Ray Data: radix cache hit rates.

Workload: G shared system prompts (each `--system-len` tokens) with `--per-group` short
questions each, run as one program per row (system, user question, `--new-tokens` greedy
tokens) through `lmprog.ray.ProgramRunner` on `--actors` actors, one Engine each. Random
routing shuffles the rows (`ds.random_shuffle`); prefix-affinity routing sorts them by the
hash of their prompt prefix (`lmprog.ray.route_by_prefix`). Both then have the same number
of blocks and batches, and each phase starts fresh actors (cold caches). The hit rate is
the share of prompt tokens the engines served from their radix caches (every request's
`cached_tokens` / `prompt_tokens`, from the rows' usage columns). It is measured twice:
with KV pools that hold every system prompt, and with pools that hold `--kv-prompts` of
`--pool-rows` rows' worth of tokens (fewer prompts than a random batch mixes), as when
prompts outgrow a replica's memory. Each
phase's rows are compared with the other routing's: greedy output does not depend on
the cache.

    .venv/bin/python benchmarks/bench_ray.py --model small
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

import lmprog as lp  # noqa: E402


@lp.function
def answer(s, system, question):
    s += lp.system(system)
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer"))


def workload(args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    """`groups` system prompts of `system_len` tokens; their rows in random order."""
    rng = random.Random(0)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) > 3]
    words.sort()
    rows = []
    for g in range(args.groups):
        system = f"You are assistant number {g}."
        while len(tokenizer(system).input_ids) < args.system_len:
            system += " " + " ".join(rng.choice(words) for _ in range(16))
        for q in range(args.per_group):
            question = " ".join(rng.choice(words) for _ in range(args.question_words)) + "?"
            rows.append({"id": g * args.per_group + q, "system": system, "question": question})
    rng.shuffle(rows)
    return rows


def run_phase(rows, routing: str, max_total_tokens: int, args, seed: int) -> list[dict]:
    import ray

    from lmprog.ray import ProgramRunner, route_by_prefix

    ds = ray.data.from_items(rows, override_num_blocks=args.blocks)
    if routing == "random":
        ds = ds.random_shuffle(seed=seed).repartition(args.blocks)
    else:
        ds = route_by_prefix(ds, answer, num_blocks=args.blocks)
    ds = ds.materialize()  # before the actors take every CPU
    options = {"max_total_tokens": max_total_tokens, "num_threads": 1, "dtype": args.dtype}
    out = ds.map_batches(
        ProgramRunner,
        fn_constructor_kwargs={
            "program": answer,
            "model": harness.resolve_model(args.model),
            "engine_options": options,
            "defaults": {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True},
            "include_usage": True,
        },
        compute=ray.data.ActorPoolStrategy(size=args.actors),
        batch_size=args.batch_size,
    )
    return sorted(out.take_all(), key=lambda r: r["id"])


def hit_rate(rows: list[dict]) -> float:
    return sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)


def computed(rows: list[dict]) -> int:
    """Prompt tokens the engines had to compute (not served from their caches)."""
    return sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=2)
    parser.add_argument("--groups", type=int, default=8, help="shared system prompts")
    parser.add_argument("--per-group", type=int, default=32, help="rows per system prompt")
    parser.add_argument("--system-len", type=int, default=384, help="tokens per system prompt")
    parser.add_argument("--question-words", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=4, help="blocks after routing")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--pool-rows",
        default="4,2",
        help="comma-separated: the pressured pools, in rows (system prompt + question) each holds",
    )
    args = parser.parse_args()

    import ray

    tokenizer = harness.load_hf_tokenizer(harness.resolve_model(args.model))
    rows = workload(args, tokenizer)
    row_tokens = args.system_len + 64 + args.question_words * 4 + args.new_tokens
    pools = {"holds every prompt": (2 * args.groups + args.batch_size) * row_tokens}
    for n in (int(x) for x in args.pool_rows.split(",")):
        pools[f"holds {n} rows"] = n * row_tokens
    ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().wait_for_min_actors_s = 600  # every actor gets work
    result_rows, phases_out, checks = [], {}, {}
    seeds = itertools.count()  # a new shuffle each random phase
    for label, pool in pools.items():
        phases = [
            harness.Phase(
                f"{routing} ({label})",
                lambda routing=routing, pool=pool: run_phase(
                    rows, routing, pool, args, seed=next(seeds)
                ),
            )
            for routing in ("random", "prefix-affinity")
        ]
        harness.alternate(phases, args.repeats)
        random_side, affinity = phases
        rates = {p.name: [hit_rate(v) for v in p.values] for p in phases}
        equal = sum(
            a["answer"] == b["answer"] and a["error"] is None and b["error"] is None
            for a, b in zip(random_side.values[0], affinity.values[0], strict=True)
        )
        checks[label] = {"rows_equal": equal, "hit_rates": rates}
        for phase in phases:
            best = max(rates[phase.name])
            base = max(rates[random_side.name])
            result_rows.append(
                {
                    "KV pool per actor": f"{pool:,} tokens ({label})",
                    "routing": phase.name.split(" (")[0],
                    "cache hit rate (best / worst round)": f"{best:.1%} / {min(rates[phase.name]):.1%}",
                    # (random routing may reuse nothing at small sizes: no ratio then)
                    "vs random (best)": f"{best / base:.2f}x" if base else "-",
                    "prompt tokens computed (best)": f"{min(computed(v) for v in phase.values):,}",
                    "time (s, best / median)": f"{phase.best:.1f} / {phase.median:.1f}",
                    "outputs": f"{equal}/{len(rows)} rows equal across routings",
                }
            )
        phases_out[label] = {p.name: p.timing() for p in phases}
    ray.shutdown()
    harness.write_result(
        args,
        "ray",
        {
            "title": "Ray Data: prefix-affinity vs random routing",
            "workload": (
                f"{args.groups} system prompts of {args.system_len} tokens x {args.per_group} "
                f"questions ({len(rows)} rows, shuffled), one program per row (system, user, "
                f"{args.new_tokens} greedy tokens); {args.actors} actors with one Engine each, "
                f"{args.blocks} blocks, batches of {args.batch_size}; fresh actors per phase; "
                f"{args.repeats} rounds in alternating order"
            ),
            "columns": list(result_rows[0]),
            "rows": result_rows,
            "timings": phases_out,
            "checks": checks,
            "param_dtypes": {"engine": args.dtype},
        },
    )


if __name__ == "__main__":
    main()
