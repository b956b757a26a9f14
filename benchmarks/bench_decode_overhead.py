"""Time per decode step spent outside the model forward, by output length (issue 14).

A batch of long generations (every request `ignore_eos`, half with stop strings and a stop
regex that never match, half constrained by a JSON-like regex with jump-forward) runs on
one engine; greedy, or with `--sampled` seeded temperature / top-p sampling. Each
loop iteration (take input, schedule, forward, sample, stop checks, stream, finish) is
timed, and so is its forward; the rest is the overhead. Iterations are grouped by the mean
output length of their batch, so an overhead that grows with the output shows as a rising
column. `--baseline COMMIT` runs the same workload on that commit's runtime (a git
worktree under /tmp) in the same invocation, each side in its own process.

    .venv/bin/python benchmarks/bench_decode_overhead.py [--batch 64,256] [--tokens 2000]
        [--model small] [--baseline dab3469] [--sampled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = (100, 500, 1000, 1500, 2000)
STOPS = ["\n\n\nEND OF TEXT", "STOP!STOP!"]
STOP_REGEX = r"STOP[0-9]{3}!"
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
# 300 items (~2,400 tokens): the pattern cannot end before the token budget does.
JSON_REGEX = r'(\{"id": [0-9]{1,4}\}, ){300}'


def params(i: int, tokens: int, sampled: bool = False) -> dict[str, Any]:
    base = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if sampled:
        base.update(SAMPLED, seed=i)
    if i % 2 == 0:
        return {**base, "stop": STOPS, "stop_regex": STOP_REGEX}
    return {**base, "regex": JSON_REGEX}


def worker(args: argparse.Namespace) -> None:
    import lmprog_runtime
    from lmprog_runtime import Engine

    batch = args.worker_batch
    engine = Engine(
        harness.resolve_model(args.model),
        dtype=args.dtype,
        max_total_tokens=batch * (args.tokens + 64) + 4096,
        max_running_requests=batch,
    )
    harness.warm_engine(engine)
    engine.generate("warm the regex", params(1, 8))  # compiles the grammar (untimed)
    harness.flush(engine)
    steps: list[tuple[float, float, float, int]] = []  # (total, forward, mean len, batch)
    forward_of: list[float] = []
    record = engine._stats.record_step

    def record_step(batch_: Any, **kw: Any) -> Any:
        forward_of.append(kw["forward_seconds"])
        return record(batch_, **kw)

    engine._stats.record_step = record_step
    run_once = engine._run_once

    def timed_run_once() -> None:
        forward_of.clear()
        running = list(engine.scheduler.running)
        start = time.perf_counter()
        run_once()
        total = time.perf_counter() - start
        if forward_of and running:
            mean_len = statistics.fmean(len(r.output_ids) for r in running)
            steps.append((total, forward_of[0], mean_len, len(running)))

    engine._run_once = timed_run_once
    prompts = [f"Record {i}: " for i in range(batch)]
    start = time.perf_counter()
    outs = engine.generate(prompts, [params(i, args.tokens, args.sampled) for i in range(batch)])
    seconds = time.perf_counter() - start
    lengths = [o["meta_info"]["completion_tokens"] for o in outs]
    engine.shutdown()
    result = {
        "lmprog_runtime": lmprog_runtime.__file__,
        "seconds": seconds,
        "steps": steps,
        "lengths": lengths,
    }
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")


def buckets(steps: list[list[float]]) -> dict[int, tuple[float, float, int]]:
    """Per output-length bucket: (median overhead fraction, median step ms, steps)."""
    out = {}
    lower = 0
    for upper in BUCKETS:
        chosen = [s for s in steps if lower < s[2] <= upper]
        if chosen:
            fractions = [(t - f) / t for t, f, _, _ in chosen]
            out[upper] = (
                statistics.median(fractions),
                1000 * statistics.median(t for t, _, _, _ in chosen),
                len(chosen),
            )
        lower = upper
    return out


def run_side(
    root: Path, env: dict[str, str], batch: int, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    out = tmp / f"side-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker-batch",
        str(batch),
        "--model",
        args.model,
        "--tokens",
        str(args.tokens),
        "--dtype",
        args.dtype,
        "--out",
        str(out),
    ]
    if args.sampled:
        cmd.append("--sampled")
    env = {**env, "PYTHONPATH": str(root)}
    subprocess.run(cmd, env=env, check=True, cwd=str(ROOT / "benchmarks"))
    result = json.loads(out.read_text(encoding="utf-8"))
    if not Path(result["lmprog_runtime"]).resolve().is_relative_to(root):
        raise RuntimeError(f"imported {result['lmprog_runtime']}, not {root}'s runtime")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=1)
    parser.add_argument("--batch", default="64,256", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=2000, help="output tokens per request")
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument(
        "--sampled", action="store_true", help=f"seeded sampling ({SAMPLED}) instead of greedy"
    )
    parser.add_argument("--worker-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_batch:
        return worker(args)
    sides = harness.sides(args.baseline)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_decode_overhead-") as tmpdir:
        for batch in [int(b) for b in args.batch.split(",")]:
            for name, (root, env) in sides.items():
                result = run_side(root, env, batch, args, Path(tmpdir))
                table = buckets(result["steps"])
                raw[f"{name} batch {batch}"] = {
                    "seconds": result["seconds"],
                    "lengths": result["lengths"],
                    "buckets": table,
                }
                row = {
                    "batch": str(batch),
                    "runtime": name,
                    "total (s)": f"{result['seconds']:.1f}",
                }
                for upper in BUCKETS:
                    cell = table.get(upper)
                    row[f"outside forward, tokens <= {upper}"] = (
                        "-" if cell is None else f"{100 * cell[0]:.1f}% of {cell[1]:.0f} ms"
                    )
                rows.append(row)
                print(row, flush=True)
    harness.write_result(
        args,
        "decode_overhead_sampled" if args.sampled else "decode_overhead",
        {
            "title": "Decode-step time outside the model forward, by output length",
            "workload": (
                f"batch of requests generating {args.tokens} tokens each (ignore_eos), "
                f"{'seeded sampling ' + str(SAMPLED) if args.sampled else 'greedy'}, half "
                f"with stop strings {STOPS} and stop regex {STOP_REGEX!r} that never match, "
                "half constrained to "
                f"{JSON_REGEX!r} with jump-forward; per loop iteration, the share of its "
                "time not in the model forward (median over the iterations whose batch's "
                "mean output length falls in each bucket), and the median iteration time"
            ),
            "columns": list(rows[0]),
            "rows": rows,
            "raw": raw,
        },
    )


if __name__ == "__main__":
    main()
