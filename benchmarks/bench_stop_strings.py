"""Many stop strings on the engine loop: a request's 300 greedy tokens on the built-in
`tiny` model (where the model's work is small, so the loop's own is seen) with N stop
strings, none of which is ever there, the by-length search (`stop_strings.py`, used past
`FIND_EACH_MAX` strings) against `str.find` for each string (the search before it), in
one run, each the best of `--repeats` rounds. Then the search alone, both ways, for 20
stop strings of 20 lengths (which keep `str.find`): over a token's few new places, and
the final scan of a whole 8,000-character output.

    .venv/bin/python benchmarks/bench_stop_strings.py [--counts 0,16,1000,50000]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import best_seconds  # noqa: E402

import lmprog_runtime.stop_strings as stop_strings  # noqa: E402
from lmprog_runtime import Engine  # noqa: E402

PROMPT = "The capital of France is"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="0,16,1000,50000")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    engine = Engine("tiny")
    try:
        for count in (int(c) for c in args.counts.split(",")):
            params = {
                "max_new_tokens": args.tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [f"zq{i}xw" for i in range(count)],
            }
            run = functools.partial(engine.generate, PROMPT, params)
            by_length = best_seconds(run, 1, args.repeats)
            threshold = stop_strings.FIND_EACH_MAX
            stop_strings.FIND_EACH_MAX = max(count, threshold)  # each string with str.find
            try:
                find_each = best_seconds(run, 1, args.repeats)
            finally:
                stop_strings.FIND_EACH_MAX = threshold
            print(
                f"{count:6d} stop strings: {args.tokens} tokens {by_length:.3f} s, "
                f"str.find each {find_each:.3f} s ({find_each / by_length:.2f}x)"
            )
    finally:
        engine.shutdown()
    twenty = stop_strings.StopStrings(["<" + "s" * i + ">" for i in range(20)])
    output = "y" * 8000
    for what, start in (("a token's new places", len(output) - 24), ("the final scan", 0)):
        find_each = best_seconds(lambda s=start: twenty.find_each(output, s, 0), 20, args.repeats)
        by_length = best_seconds(
            lambda s=start: twenty.first_by_length(output, s, 0), 20, args.repeats
        )
        print(
            f"20 stop strings, {what}: str.find each {1e3 * find_each:.3f} ms, by length "
            f"{1e3 * by_length:.3f} ms ({by_length / find_each:.1f}x the time)"
        )


if __name__ == "__main__":
    main()
