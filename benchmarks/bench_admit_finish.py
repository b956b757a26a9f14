"""The engine's fixed costs per request: the caller's CPU time building the requests
(`Engine._make_reqs`: checking the arguments, reading the sampling parameters), and the
loop's admitting them (`Scheduler._schedule_extend`), putting their prompts in the prefix
cache after the prefill (`Scheduler.on_forward_done`) and finishing them
(`EngineLoop._finish`), on the CPU (tiny model, 8-token prompts, 2 new tokens, greedy;
best of 5; each on the thread it runs on). With `--tokens N` (N > 2) it also times the
check of a decode step's new tokens (`EngineLoop._check`) at the steps that finish no
request, in microseconds a step. `--prompt N` makes the prompts N tokens long,
each its own (putting a prompt in the cache and finishing should not cost more for a
longer one, beyond its new tokens). `--cached` runs the same requests again without
flushing the cache in between (a dataset's repeated prompts, a rerun): a prompt's tokens
and the greedy output's are then in the tree already, and caching them frees the
request's own slots as duplicates. A benchmark of N new
tokens pays them in every step's average, divided by N. `--baseline COMMIT` times that
commit's runtime too, the two alternated, each run in its own process.

    .venv/bin/python benchmarks/bench_admit_finish.py [--batch 64,256] [--prompt 8]
        [--tokens 2] [--baseline ab94d64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]


# building the requests (the caller's thread); admitting a batch; after its prefill,
# putting the prompts in the prefix cache (each request's row then reads the tree's
# slots); finishing each request.
WHAT = ("make", "admit", "cache_prompt", "finish")


def measure(root: Path, batch: int, prompt: int = 8, tokens: int = 2, cached: bool = False) -> dict:
    """(run in a process of its own, `root`'s runtime first on the path)"""
    sys.path.insert(0, str(root))
    from lmprog_runtime import Engine, default_model_path, engine, engine_loop, scheduler

    spent = dict.fromkeys(WHAT, 0.0)

    def timed(owner, name: str, key: str, counts=lambda args, out: True) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            out = fn(*args, **kwargs)
            if counts(args, out):
                spent[key] += time.thread_time() - start
            return out

        setattr(owner, name, wrapper)

    def prefill(args, out) -> bool:  # (a decode step's commit caches no prompt)
        return args[1].mode.name == "EXTEND"

    timed(engine.Engine, "_make_reqs", "make")
    timed(scheduler.Scheduler, "_schedule_extend", "admit", lambda args, out: out is not None)
    timed(scheduler.Scheduler, "on_forward_done", "cache_prompt", prefill)
    stopping = [False]  # inside `_finish_stopped`, timed as a whole (the texts decoded first)
    timed(engine_loop.EngineLoop, "_finish", "finish", lambda args, out: not stopping[0])
    finish_stopped = getattr(engine_loop.EngineLoop, "_finish_stopped", None)
    if finish_stopped is not None:

        def timed_finish_stopped(self, reqs):
            stopping[0], start = True, time.thread_time()
            try:
                finish_stopped(self, reqs)
            finally:
                stopping[0] = False
                spent["finish"] += time.thread_time() - start

        engine_loop.EngineLoop._finish_stopped = timed_finish_stopped
    checks: list[float] = []  # a decode step's check of the whole batch, finishing none
    check = engine_loop.EngineLoop._check

    def timed_check(self, reqs):
        released, start = self._released, time.thread_time()
        check(self, reqs)
        if len(reqs) == batch and self._released == released:
            checks.append(time.thread_time() - start)

    engine_loop.EngineLoop._check = timed_check
    prompts = [[5 + (i * 7 + j) % 1000 for j in range(prompt)] for i in range(batch)]
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    best = dict.fromkeys(WHAT, float("inf"))
    path = default_model_path("tiny")
    with Engine(path, max_running_requests=batch, max_prefill_tokens=16384) as running:
        running.generate(input_ids=prompts, sampling_params=params)  # warm-up
        checks.clear()
        for _ in range(5):
            if not cached:
                running.flush_cache()
            spent.update(dict.fromkeys(WHAT, 0.0))
            running.generate(input_ids=prompts, sampling_params=params)
            best = {k: min(best[k], spent[k]) for k in best}
    out = {f"{k}_ms": 1e3 * v for k, v in best.items()}
    return out | {"check_us": 1e6 * sum(checks) / len(checks) if checks else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="64,256", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=8, help="tokens per prompt")
    parser.add_argument("--tokens", type=int, default=2, help="new tokens per request")
    parser.add_argument("--cached", action="store_true", help="the requests' tokens cached")
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the sides")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.side:
        results = {
            b: measure(Path(args.side), b, args.prompt, args.tokens, args.cached) for b in batches
        }
        from lmprog_runtime import engine_loop

        print(json.dumps({**results, "runtime": engine_loop.__file__}))
        return
    sides = {"this tree": (ROOT, dict(os.environ))}
    if args.baseline:
        sides[args.baseline] = harness.baseline_worktree(args.baseline)
    seen = harness.run_rounds(
        sides,
        args.rounds,
        lambda root: (
            [sys.executable, __file__, "--side", str(root), "--batch", args.batch]
            + ["--prompt", str(args.prompt), "--tokens", str(args.tokens)]
            + (["--cached"] if args.cached else [])
        ),
    )
    print("CPU time (ms; make on the caller's thread, the rest on the loop's), prompts of")
    print(f"{args.prompt} tokens, range over the rounds, best of 5 within each")
    for b in batches:
        for what in WHAT:
            cells = harness.range_cells(seen, lambda r, b=b, w=what: r[str(b)][f"{w}_ms"], 2)
            print(f"  {what} {b:4} requests: {cells}")
        if args.tokens > 2:
            cells = harness.range_cells(seen, lambda r, b=b: r[str(b)]["check_us"], 1)
            print(f"  check of a step (us, mean) {b:4} requests: {cells}")


if __name__ == "__main__":
    main()
