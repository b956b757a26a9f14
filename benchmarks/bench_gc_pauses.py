"""The cyclic garbage collector's pauses during one `generate` of a dataset, with the heap
frozen while the engine works (`gc_freeze=True`, the default; `lmprog_runtime/gc_freeze.py`)
and without (`gc_freeze=False`), each side in a process of its own, alternated `--rounds`
times; with `--baseline COMMIT`, that commit's runtime as a third side (its own defaults).

Every collector pass stops all threads, the engine loop's included, for as long as it walks
the objects it tracks; on a GPU that is time the GPU sits idle. The workload is a dataset's
rows submitted at once (`--requests` prompts of 8 tokens each its own, 4 to 16 new tokens,
greedy; tiny model, CPU, 64 running at a time): a request finishes and another is admitted
at nearly every step, and the radix tree keeps every finished one. A callback on the
collector times each pass (`gc.callbacks`), full passes (generation 2) and young ones apart.

    .venv/bin/python benchmarks/bench_gc_pauses.py [--requests 8192] [--rounds 2]
        [--baseline 94b9053]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"frozen": "1", "not frozen": "0"}  # side -> gc_freeze (BENCH_GC_FREEZE)


def measure(requests: int) -> dict:
    """(run in a process of its own; gc_freeze from the environment, if set)"""
    from lmprog_runtime import Engine, default_model_path

    passes: list[tuple[int, float]] = []  # (generation, seconds) of each pass
    started: dict[int, float] = {}

    def on_pass(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif 0 in started:
            passes.append((info["generation"], time.perf_counter() - started.pop(0)))

    prompts = [[5 + (i * 131 + j * 7) % 1000 for j in range(8)] for i in range(requests)]
    params = [
        {"max_new_tokens": 4 + i % 13, "temperature": 0, "ignore_eos": True}
        for i in range(requests)
    ]
    flag = os.environ.get("BENCH_GC_FREEZE")
    freeze = {} if flag is None else {"gc_freeze": flag == "1"}
    path = default_model_path("tiny")
    with Engine(path, max_running_requests=64, **freeze) as engine:
        engine.generate(input_ids=prompts[:64], sampling_params=params[:64])  # warm-up
        gc.callbacks.append(on_pass)
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - start
        gc.callbacks.remove(on_pass)
        tracked = len(gc.get_objects())  # (what a full pass walks: the frozen are left out)
    full = [s for g, s in passes if g == 2]
    young = [s for g, s in passes if g < 2]
    return {
        "wall_s": wall,
        "full_passes": len(full),
        "full_ms": 1e3 * sum(full),
        "full_max_ms": 1e3 * max(full, default=0.0),
        "young_passes": len(young),
        "young_ms": 1e3 * sum(young),
        "tracked": tracked,
        "runtime": sys.modules["lmprog_runtime"].__file__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the sides")
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        sys.path.insert(0, args.side)
        print(json.dumps(measure(args.requests)))
        return
    sides = {name: (ROOT, {**os.environ, "BENCH_GC_FREEZE": flag}) for name, flag in SIDES.items()}
    if args.baseline:
        sides[args.baseline] = harness.baseline_worktree(args.baseline)
    seen = harness.run_rounds(
        sides,
        args.rounds,
        lambda root: (
            [sys.executable, __file__, "--side", str(root)] + ["--requests", str(args.requests)]
        ),
    )
    print(f"one generate of {args.requests} requests (tiny, CPU, 64 running), per round:")
    for name, results in seen.items():
        for r in results:
            print(
                f"  {name:10}: {r['wall_s']:.2f} s; full passes {r['full_passes']} "
                f"({r['full_ms']:.0f} ms, longest {r['full_max_ms']:.1f} ms); young passes "
                f"{r['young_passes']} ({r['young_ms']:.0f} ms); tracked after: {r['tracked']:,}"
            )
    walls = {name: min(r["wall_s"] for r in results) for name, results in seen.items()}
    longest = {name: max(r["full_max_ms"] for r in results) for name, results in seen.items()}
    for name in list(seen)[1:]:
        ratio = longest[name] / longest["frozen"] if longest["frozen"] else float("inf")
        print(
            f"  {name} / frozen: generate's best wall time {walls[name] / walls['frozen']:.2f}x, "
            f"longest full pass {ratio:.1f}x"
        )


if __name__ == "__main__":
    main()
