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

`--workload cli` runs the rows through the `lmprog generate` command instead (in-process:
`lmprog.cli.main`, one program a row on the map's threads, results written to a JSONL
file), the Engine it builds given each side's `gc_freeze`; "in flight" then ends with the
last forward, and the wall time when the command returns.

`--workload calls` makes `--requests` `generate` calls of one request each, `--gap-ms`
apart, as a script or a notebook does; before each call it makes a cycle (holding `--load`
floats, heap the collector does not count) and drops it five calls later. It reports how
many of the dropped cycles are still alive at the end (garbage the collector kept) and
every pass from the first call to the last.

    .venv/bin/python benchmarks/bench_gc_pauses.py [--requests 32768] [--rounds 2]
        [--baseline 94b9053] [--workload engine|cli|calls] [--gap-ms 0] [--load 0]
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


class PassTimes:
    """The collector's passes while installed (`gc.callbacks`): (generation, start,
    seconds) of each."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((info["generation"], self._start, time.perf_counter() - self._start))

    def summary(self, begin: float, end: float) -> dict:
        """Full passes before `begin`, from it to `end` (in flight) and after; young ones."""
        passes = self.passes
        before = [s for g, t, s in passes if g == 2 and t < begin]
        full = [s for g, t, s in passes if g == 2 and begin <= t < end]
        after = [s for g, t, s in passes if g == 2 and t >= end]
        young = [s for g, t, s in passes if g < 2]
        return {
            "before_passes": len(before),
            "before_ms": 1e3 * sum(before),
            "full_passes": len(full),
            "full_ms": 1e3 * sum(full),
            "full_max_ms": 1e3 * max(full, default=0.0),
            "after_passes": len(after),
            "after_ms": 1e3 * sum(after),
            "young_passes": len(young),
            "young_ms": 1e3 * sum(young),
            "runtime": sys.modules["lmprog_runtime"].__file__,
        }


def freeze_option() -> dict:
    flag = os.environ.get("BENCH_GC_FREEZE")
    return {} if flag is None else {"gc_freeze": flag == "1"}


def timing_forwards(engine) -> list[float]:
    """[start of the engine's first forward from now, end of its latest] (filled as they
    run)."""
    forward, span = engine.runner.forward, []

    def timed(batch):
        if not span:
            span.append(time.perf_counter())
        try:
            return forward(batch)
        finally:
            span[1:] = [time.perf_counter()]

    engine.runner.forward = timed
    return span


def measure(requests: int) -> dict:
    """(run in a process of its own; gc_freeze from the environment, if set)"""
    from lmprog_runtime import Engine, default_model_path

    prompts = [[5 + (i * 131 + j * 7) % 1000 for j in range(8)] for i in range(requests)]
    params = [
        {"max_new_tokens": 4 + i % 13, "temperature": 0, "ignore_eos": True}
        for i in range(requests)
    ]
    path = default_model_path("tiny")
    done: list[float] = []  # when each request finished (on the loop thread)
    finished = threading.Semaphore(0)

    def on_done(_) -> None:
        done.append(time.perf_counter())
        finished.release()

    times = PassTimes()
    with Engine(path, max_running_requests=64, **freeze_option()) as engine:
        engine.generate(input_ids=prompts[:64], sampling_params=params[:64])  # warm-up
        span = timing_forwards(engine)
        gc.callbacks.append(times)
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
        gc.callbacks.remove(times)
        tracked = len(gc.get_objects())  # (what a full pass walks: the frozen are left out)
    return {"wall_s": max(done) - start, "tracked": tracked, **times.summary(span[0], max(done))}


def measure_cli(requests: int) -> dict:
    """`lmprog generate` over `requests` prompts (one a line), in-process."""
    import tempfile

    import lmprog_runtime
    from lmprog import cli
    from lmprog_runtime import default_model_path

    times, built, engine = PassTimes(), [], lmprog_runtime.Engine

    def build(model: str | None, **options: object) -> object:  # (the CLI's Engine)
        built.append(engine(model, **options, **freeze_option()))
        built.append(timing_forwards(built[0]))
        return built[0]

    lmprog_runtime.Engine = build
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "prompts.txt")
        source.write_text("".join(f"Row {i} of the set says\n" for i in range(requests)))
        args = ["generate", "--input", str(source), "--quiet", "--model"]
        args += [default_model_path("tiny"), "--set", "temperature=0"]
        args += ["--set", "max_new_tokens=8", "--set", "ignore_eos=true"]
        gc.callbacks.append(times)
        start = time.perf_counter()
        cli.main([*args, "--output", str(Path(tmp, "out.jsonl"))])
        end = time.perf_counter()
        time.sleep(1.0)  # (the loop goes idle: a pass it runs then is counted "after")
        gc.callbacks.remove(times)
        tracked = len(gc.get_objects())
    built[0].shutdown()
    first, last = built[1]
    return {"wall_s": end - start, "tracked": tracked, **times.summary(first, last)}


def measure_calls(calls: int, gap_s: float, load: int) -> dict:
    """`calls` calls of `generate`, `gap_s` apart, each after making a cycle that is dropped
    five calls later; how many of those dropped are still alive at the end."""
    import weakref

    from lmprog_runtime import Engine, default_model_path

    class Cycle:
        def __init__(self) -> None:
            self.me, self.load = self, [float(i) for i in range(load)]

    times, refs, alive = PassTimes(), [], []
    params = {"max_new_tokens": 2, "temperature": 0}
    with Engine(default_model_path("tiny"), **freeze_option()) as engine:
        engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)  # warm-up
        gc.callbacks.append(times)
        start = time.perf_counter()
        for _ in range(calls):
            alive.append(Cycle())
            refs.append(weakref.ref(alive[-1]))
            del alive[:-5]
            engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)
            time.sleep(gap_s)
        end = time.perf_counter()
        time.sleep(1.0)  # (the loop goes idle)
        gc.callbacks.remove(times)
        kept = sum(ref() is not None for ref in refs) - len(alive)
        tracked = len(gc.get_objects())
    return {"wall_s": end - start, "tracked": tracked, "kept": kept, **times.summary(start, end)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the sides")
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument("--workload", choices=["engine", "cli", "calls"], default="engine")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="calls: between calls")
    parser.add_argument("--load", type=int, default=0, help="calls: floats a cycle holds")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        sys.path.insert(0, args.side)
        if args.workload == "calls":
            result = measure_calls(args.requests, args.gap_ms / 1e3, args.load)
        else:
            result = (measure if args.workload == "engine" else measure_cli)(args.requests)
        print(json.dumps(result))
        return
    sides = {name: (ROOT, {**os.environ, "BENCH_GC_FREEZE": flag}) for name, flag in SIDES.items()}
    if args.baseline:
        sides[args.baseline] = harness.baseline_worktree(args.baseline)
    seen = harness.run_rounds(
        sides,
        args.rounds,
        lambda root: (
            [sys.executable, __file__, "--side", str(root), "--workload", args.workload]
            + ["--requests", str(args.requests), "--gap-ms", str(args.gap_ms)]
            + ["--load", str(args.load)]
        ),
    )
    shape = {
        "engine": f"{BATCH} a submit, {WINDOW} outstanding",
        "cli": "CLI",
        "calls": f"a call each, {args.gap_ms:g} ms apart, cycles of {args.load} floats",
    }[args.workload]
    print(f"{args.requests} requests, {shape} (tiny, CPU), per round:")
    for name, results in seen.items():
        for r in results:
            print(
                f"  {name:10}: {r['wall_s']:.2f} s; full passes before the first forward "
                f"{r['before_passes']} ({r['before_ms']:.0f} ms), in flight {r['full_passes']} "
                f"({r['full_ms']:.0f} ms, longest {r['full_max_ms']:.1f} ms), after "
                f"{r['after_passes']} ({r['after_ms']:.0f} ms); young passes "
                f"{r['young_passes']} ({r['young_ms']:.0f} ms); tracked after: {r['tracked']:,}"
                + (f"; dropped cycles still alive: {r['kept']}" if "kept" in r else "")
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
