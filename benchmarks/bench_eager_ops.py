"""The ops a decode step queues outside its CUDA graph, counted exactly on a CPU.

On an H200 every eager torch op costs the host about 15 us (`gpu_check.py`'s `host_costs`),
so the ops a decode step runs around its graph replay are much of the host's share of the
step. Here the decode graph runs eagerly (`DecodeGraphRunner(capture=False)`: the same
padded static-buffer path a replay runs, on the CPU), and a `TorchDispatchMode` on the loop
thread counts the aten ops of each loop iteration (views apart: they launch nothing), leaving out those of the graph's
forward and of the static batch an eager run builds for it (on CUDA, one replay). Tiny model, torch attention, greedy, every request decoding
to the end; the overlapped loop's forward worker runs on the loop thread, as on CUDA.

What a CPU cannot show: on CUDA an op on host tensors (building the inputs' block) costs
less than a launch, and the events, stream switches and pinned staging a step queues on
CUDA are no aten ops (`gpu_check.py` times those). A draw's copy of its tokens to the host
counts as one op (on CUDA one copy; a CPU makes one, or none). The count does not move with the
machine's load, so two trees compare exactly. `--baseline COMMIT` counts that commit's
runtime too (a git worktree under /tmp, its own model cache), each side in its own process.

    .venv/bin/python benchmarks/bench_eager_ops.py [--batch 64] [--tokens 16] [--baseline 9d48555]
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import threading
from pathlib import Path

import harness

# name -> (overlap, decode_steps)
LOOPS = {
    "synchronous": (False, 1),
    "overlapped, one thread (as on CUDA)": (True, 1),
    "decode runs of 8": (False, 8),
}


def count(root: Path, loop: str, batch: int, tokens: int) -> dict:
    """Aten ops per loop iteration of `root`'s runtime outside the graph's forward (run in
    a process of its own)."""
    sys.path.insert(0, str(root))
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmprog_runtime import Engine, decode_run, default_model_path, engine_loop, logprobs
    from lmprog_runtime.cuda_graph import DecodeGraphRunner
    from lmprog_runtime.forward_worker import ForwardWorker

    inside = threading.local()
    iterations: list[collections.Counter] = []
    replays: list[int] = []
    counting = [False]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not getattr(inside, "graph", False):  # (views: "name (view)")
                name = func.overloadpacket.__name__ + (" (view)" if func.is_view else "")
                iterations[-1][name] += 1
            return func(*args, **(kwargs or {}))

    def uncounted(fn, instead: str | None = None):
        """`fn`'s ops not counted (a replay's part of the step), or counted as one op
        named `instead`."""

        def wrapped(*args):
            if instead is not None and counting[0] and not getattr(inside, "graph", False):
                iterations[-1][instead] += 1
            inside.graph = True
            try:
                return fn(*args)
            finally:
                inside.graph = False

        return wrapped

    graph_run = DecodeGraphRunner.run
    run_greedy = getattr(DecodeGraphRunner, "run_greedy", None)  # (a whole run's graph)

    def counted_run(self, fb):
        if counting[0]:
            replays[-1] += 1
        return graph_run(self, fb)

    def counted_run_greedy(self, first, ahead, *args):
        if counting[0]:
            replays[-1] += 1 + ahead.shape[0]  # (its steps)
        return run_greedy(self, first, ahead, *args)

    run_once = engine_loop.EngineLoop._run_once

    def counted_run_once(self):
        if not counting[0]:
            return run_once(self)
        iterations.append(collections.Counter())
        replays.append(0)
        with Counting():
            return run_once(self)

    # The forward, the views of the static buffers an eager run makes for it, and where it
    # keeps its outputs (`_as_replayed`, where a tree has it).
    DecodeGraphRunner._forward = uncounted(DecodeGraphRunner._forward)
    DecodeGraphRunner._eager_batch = uncounted(DecodeGraphRunner._eager_batch)
    for name in ("_as_replayed", "_forward_run", "_eager_run_batches", "_as_replayed_run"):
        if hasattr(DecodeGraphRunner, name):  # (where a tree has them)
            setattr(DecodeGraphRunner, name, uncounted(getattr(DecodeGraphRunner, name)))
    if run_greedy is not None:
        DecodeGraphRunner.run_greedy = counted_run_greedy
    # A copy to the host: one op on CUDA (a CPU makes one or none): counted as one.
    for module in (logprobs, decode_run):
        if hasattr(module, "to_host_async"):
            module.to_host_async = uncounted(module.to_host_async, "to host (copy)")
    DecodeGraphRunner.run = counted_run
    engine_loop.EngineLoop._run_once = counted_run_once
    overlap, steps = LOOPS[loop]
    config = {"attention_backend": "torch", "max_running_requests": batch}
    with Engine(
        default_model_path("tiny"), overlap_schedule=overlap, decode_steps=steps, **config
    ) as engine:
        if overlap:
            engine._worker.close()
            engine._worker = ForwardWorker(engine.runner, threaded=False)
        engine.runner.graphs = DecodeGraphRunner(engine.runner, capture=False)
        prompts = [[5 + (i * 7 + j) % 1000 for j in range(8)] for i in range(batch)]
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        engine.flush_cache()
        counting[0] = True
        engine.generate(input_ids=prompts, sampling_params=params)
        counting[0] = False
    # Steady decode iterations: one graph run each (a run of K steps: K graph runs).
    steady = [c for c, n in zip(iterations, replays) if n == (1 if steps == 1 else steps)]
    if not steady:
        raise ValueError(f"--tokens {tokens}: too few for a steady step of {loop!r}")
    totals = [sum(n for op, n in c.items() if not op.endswith("(view)")) for c in steady]
    median = statistics.median(totals)
    typical = steady[totals.index(min(totals, key=lambda t: abs(t - median)))]
    views = sum(n for op, n in typical.items() if op.endswith("(view)"))
    return {
        "runtime": str(Path(engine_loop.__file__).resolve().parent),
        "median": median / (1 if steps == 1 else steps),
        "views": views / (1 if steps == 1 else steps),
        "steady_iterations": len(steady),
        "ops": dict(typical.most_common()),
    }


def main() -> None:
    args = harness.loop_count_args(__doc__.split("\n\n")[0], tokens=16)
    if args.side:
        print(json.dumps(count(Path(args.side), args.loop, args.batch, args.tokens)))
        return
    sides = harness.sides(args.baseline)
    print(f"batch {args.batch}, {args.tokens} new tokens, greedy; aten ops per decode step")
    print("outside the graph's forward, on the loop thread (median of the steady steps),")
    print("views (no kernel, only the dispatcher's time) counted apart")
    for loop in LOOPS:
        counted = {
            name: harness.run_loop_side(__file__, root, loop, args, env)
            for name, (root, env) in sides.items()
        }
        cells = [f"{name} {c['median']:g} (+{c['views']:g} views)" for name, c in counted.items()]
        print(f"  {loop:36}: " + "; ".join(cells))
        for name, c in counted.items():
            ops = ", ".join(f"{op} {n}" for op, n in c["ops"].items())
            print(f"      {name}: {ops}")


if __name__ == "__main__":
    main()
