"""How the host's work grows with a program's shape, on the built-in `tiny` model (whose
forwards are short, so the host's own work is seen): a fork of N branches of one token
each, a select of N choices, a chat of N turns written as text, and a join gathering N
variables from each of 4 branches. Each shape at N and 4N, the best of `--repeats`; the
figure is the time per unit (branch, choice, turn, variable) at 4N over that at N: about 1
where the work grows linearly, about 4 where it grows as N^2.

    .venv/bin/python benchmarks/bench_host_scaling.py [--sizes 1024,4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import best_seconds  # noqa: E402

import lmprog as lp  # noqa: E402


@lp.function
def wide_fork(s, n):
    s += "Write a word:"
    branches = s.fork(n)
    for branch in branches:
        branch += lp.gen("w", max_tokens=1, temperature=0)
    branches.join()


@lp.function
def many_choices(s, n):
    s += "Pick:" + lp.select("c", choices=[f" o{i}" for i in range(n)])


@lp.function
def long_chat(s, n):
    for i in range(n):
        s += lp.user(f"Question {i}?")
        s += lp.assistant(f"Answer {i}.")


@lp.function
def gathered(s, n):
    branches = s.fork(4)
    for k, branch in enumerate(branches):
        for i in range(n):
            branch.set_var(f"v{i}", k)
    branches.join()


SHAPES = {"fork": wide_fork, "select": many_choices, "chat": long_chat, "gather": gathered}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,4096", help="N,4N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    small, large = (int(n) for n in args.sizes.split(","))
    engine = lp.Engine("tiny")
    try:
        print(f"{'shape':8} {'N':>6} {'s':>8} {'4N':>6} {'s':>8}  per unit 4N / N")
        for name in args.shapes.split(","):
            program = SHAPES[name]
            seconds = []
            for n in (small, large):

                def run(n=n, program=program):
                    engine.flush_cache()
                    state = program.run(n=n, backend=engine)
                    if state.error() is not None:
                        raise state.error()

                seconds.append(best_seconds(run, 1, args.repeats))
            growth = (seconds[1] / large) / (seconds[0] / small)
            print(f"{name:8} {small:6} {seconds[0]:8.3f} {large:6} {seconds[1]:8.3f}  {growth:.2f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
