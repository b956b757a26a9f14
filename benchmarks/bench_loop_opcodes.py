"""The engine loop's Python work per iteration, counted exactly: the bytecode instructions
`lmprog_runtime` runs on the loop thread (`sys.settrace` with opcode events), on
`bench_host_path.py`'s emulated device (tiny model, greedy, everything but the forward
real). A count does not move with the machine's load, so two trees compare exactly on a
shared, noisy machine, where their timings differ by less than the noise.

Per loop: the median iteration (a steady decode step at batch 64; with decode runs, a run)
and the total over one generate (admission and finishes included). `--baseline COMMIT`
counts that commit's runtime too (a git worktree under /tmp, its own model cache), each
side in its own process.

    .venv/bin/python benchmarks/bench_loop_opcodes.py [--batch 64] [--tokens 32] [--baseline ab94d64]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import harness

# name -> (overlap, threaded worker, decode_steps), as bench_host_path's loops
LOOPS = {
    "synchronous": (False, True, 1),
    "overlapped, one thread": (True, False, 1),
    "decode runs of 8": (False, True, 8),
}


def count(root: Path, loop: str, batch: int, tokens: int) -> dict:
    """Opcodes per loop iteration of `root`'s runtime (run in a process of its own)."""
    sys.path[:0] = [str(root / "benchmarks"), str(root)]
    import bench_host_path

    import lmprog_runtime.engine as engine_module
    from lmprog_runtime import engine_loop

    package = str(root / "lmprog_runtime")
    per_iteration: list[int] = []
    counting = [False]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return None
        frame.f_trace_opcodes = True
        return local

    def local(frame, event, arg):
        if event == "opcode":
            per_iteration[-1] += 1
        return local

    run_once = engine_loop.EngineLoop._run_once

    def counted_run_once(self):
        if not counting[0]:
            return run_once(self)
        per_iteration.append(0)
        sys.settrace(tracer)
        try:
            return run_once(self)
        finally:
            sys.settrace(None)

    flush = engine_module.Engine.flush_cache

    def flush_then_count(self, *args, **kwargs):  # (called once the warm-up is over)
        counting[0] = True
        return flush(self, *args, **kwargs)

    engine_loop.EngineLoop._run_once = counted_run_once
    engine_module.Engine.flush_cache = flush_then_count
    overlap, threaded, steps = LOOPS[loop]
    bench_host_path.host_path(batch, 3e-4, 1e-4, tokens, 1, overlap, threaded, steps)
    return {
        "runtime": str(Path(engine_loop.__file__).resolve().parent),
        "median": statistics.median(per_iteration),
        "total": sum(per_iteration),
        "iterations": len(per_iteration),
    }


def main() -> None:
    args = harness.loop_count_args(__doc__.split("\n\n")[0], tokens=32)
    if args.side:
        print(json.dumps(count(Path(args.side), args.loop, args.batch, args.tokens)))
        return
    sides = harness.sides(args.baseline)
    print(f"batch {args.batch}, {args.tokens} new tokens, greedy; opcodes on the loop thread")
    for loop in LOOPS:
        counted = {
            name: harness.run_loop_side(__file__, root, loop, args, env)
            for name, (root, env) in sides.items()
        }
        cells = [f"{name} {c['median']:,.0f} / {c['total']:,}" for name, c in counted.items()]
        line = f"  {loop:24}: median iteration / generate: " + "; ".join(cells)
        if args.baseline:
            base, ours = counted[args.baseline], counted["this tree"]
            line += f" ({base['median'] / ours['median']:.2f}x fewer per iteration)"
        print(line)


if __name__ == "__main__":
    main()
