"""The cyclic garbage collector's pauses during a dataset run, with the heap
frozen while the engine works (`gc_freeze=True`, the default; `lmprog_runtime/gc_freeze.py`)
and without (`gc_freeze=False`), each side in a process of its own, alternated `--rounds`
times; with `--baseline COMMIT`, that commit's runtime as a third side (its own defaults).

Every collector pass stops all threads, the engine loop's included, for as long as it walks
the objects it tracks; on a GPU that is time the GPU sits idle. The workload is a dataset's
rows, `--requests` prompts of 8 tokens each its own (4 to 16 new tokens, greedy; tiny model,
CPU, 64 running at a time), submitted 256 at a time while fewer than 1,024 are outstanding,
their results kept, as a dataset run or a server goes: a request finishes and another is
admitted at nearly every step, and the radix tree keeps every finished one. A callback on the
collector times each pass (`gc.callbacks`), full passes (generation 2) and young ones apart,
and the full passes apart by when they start: before the first forward (`submit` making the
requests, on the caller's thread, the device idle), in flight (from the first forward to
the last request's finish: what a GPU would sit idle through), and after it (where the
frozen side runs one over everything if the collector ran any while frozen). The wall time
runs from the first submit to the last request's finish.

    .venv/bin/python benchmarks/bench_gc_pauses.py [--requests 32768] [--rounds 2]
        [--baseline 94b9053]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"frozen": "1", "not frozen": "0"}  # side -> gc_freeze (BENCH_GC_FREEZE)
BATCH, WINDOW = 256, 1024  # requests per submit; at most this many outstanding


def measure(requests: int) -> dict:
    """(run in a process of its own; gc_freeze from the environment, if set)"""
    from lmprog_runtime import Engine, default_model_path

    passes: list[tuple[int, float, float]] = []  # (generation, start, seconds) of each pass
    started: dict[int, float] = {}

    def on_pass(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif 0 in started:
            start = started.pop(0)
            passes.append((info["generation"], start, time.perf_counter() - start))

    prompts = [[5 + (i * 131 + j * 7) % 1000 for j in range(8)] for i in range(requests)]
    params = [
        {"max_new_tokens": 4 + i % 13, "temperature": 0, "ignore_eos": True}
        for i in range(requests)
    ]
    flag = os.environ.get("BENCH_GC_FREEZE")
    freeze = {} if flag is None else {"gc_freeze": flag == "1"}
    path = default_model_path("tiny")
    done: list[float] = []  # when each request finished (on the loop thread)
    finished = threading.Semaphore(0)

    def on_done(_) -> None:
        done.append(time.perf_counter())
        finished.release()

    with Engine(path, max_running_requests=64, **freeze) as engine:
        engine.generate(input_ids=prompts[:64], sampling_params=params[:64])  # warm-up
        forward, first = engine.runner.forward, []  # (the first forward's start)
        engine.runner.forward = lambda batch: (
            first or first.append(time.perf_counter()),
            forward(batch),
        )[1]
        gc.callbacks.append(on_pass)
        start = time.perf_counter()
        futures = []  # (kept, as a dataset run keeps its results)
        for at in range(0, requests, BATCH):  # at most WINDOW outstanding
            while len(futures) - len(done) >= WINDOW:
                finished.acquire()
            futures += engine.submit(
                input_ids=prompts[at : at + BATCH], sampling_params=params[at : at + BATCH]
            )
            for future in futures[-BATCH:]:
                future.add_done_callback(on_done)
        concurrent.futures.wait(futures)
        time.sleep(1.0)  # (the loop goes idle: a pass it runs then is counted "after")
        gc.callbacks.remove(on_pass)
        tracked = len(gc.get_objects())  # (what a full pass walks: the frozen are left out)
    begin, end = first[0], max(done)
    before = [s for g, t, s in passes if g == 2 and t < begin]
    full = [s for g, t, s in passes if g == 2 and begin <= t < end]
    after = [s for g, t, s in passes if g == 2 and t >= end]
    young = [s for g, t, s in passes if g < 2]
    return {
        "wall_s": end - start,
        "before_passes": len(before),
        "before_ms": 1e3 * sum(before),
        "full_passes": len(full),
        "full_ms": 1e3 * sum(full),
        "full_max_ms": 1e3 * max(full, default=0.0),
        "after_passes": len(after),
        "after_ms": 1e3 * sum(after),
        "young_passes": len(young),
        "young_ms": 1e3 * sum(young),
        "tracked": tracked,
        "runtime": sys.modules["lmprog_runtime"].__file__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32768)
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
    print(
        f"{args.requests} requests, {BATCH} a submit, {WINDOW} outstanding (tiny, CPU), per round:"
    )
    for name, results in seen.items():
        for r in results:
            print(
                f"  {name:10}: {r['wall_s']:.2f} s; full passes before the first forward "
                f"{r['before_passes']} ({r['before_ms']:.0f} ms), in flight {r['full_passes']} "
                f"({r['full_ms']:.0f} ms, longest {r['full_max_ms']:.1f} ms), after "
                f"{r['after_passes']} ({r['after_ms']:.0f} ms); young passes "
                f"{r['young_passes']} ({r['young_ms']:.0f} ms); tracked after: {r['tracked']:,}"
            )
    walls = {name: min(r["wall_s"] for r in results) for name, results in seen.items()}
    longest = {name: max(r["full_max_ms"] for r in results) for name, results in seen.items()}
    for name in list(seen)[1:]:
        ratio = longest[name] / longest["frozen"] if longest["frozen"] else float("inf")
        print(
            f"  {name} / frozen: best wall time {walls[name] / walls['frozen']:.2f}x, "
            f"longest full pass {ratio:.1f}x"
        )


if __name__ == "__main__":
    main()
