"""Stop regexes: building the search and scanning a growing output.

Build: `(a|b)*a(a|b){n}`, whose DFA has 2^n states, as interegular builds its DFA up front
(the search before `regex_nfa.py`) against the NFA with its DFA built lazily, which then
scans random a/b text to its first match (the states the text needs, no more).

Scan: for a few ordinary patterns that never match, 20,000 characters fed 4 at a time (a
token's text) to the incremental scanner (`stop_regex.py`), against `re.search` over the
whole text at each feed (the search before issue 14); each the best of `--repeats`.

    .venv/bin/python benchmarks/bench_stop_regex.py [--sizes 8,10,12]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import best_seconds  # noqa: E402

from lmprog_runtime.regex_nfa import NFA  # noqa: E402
from lmprog_runtime.stop_regex import StopRegexScanner  # noqa: E402

PATTERNS = [r"STOP[0-9]{3}!", r"\n\nQuestion:", r"[A-Z][a-z]+ [A-Z][a-z]+ said:", r"[^\n]{100}END"]


def build(sizes: list[int]) -> None:
    import interegular

    rng = random.Random(0)
    text = "".join(rng.choice("ab") for _ in range(2000))
    for n in sizes:
        pattern = f"(a|b)*a(a|b){{{n}}}"
        start = time.perf_counter()
        interegular.parse_pattern(pattern).to_fsm()
        up_front = time.perf_counter() - start
        start = time.perf_counter()
        scanner = StopRegexScanner([pattern])  # (a new pattern: built here)
        for i in range(0, len(text), 4):
            scanner.feed(text[: i + 4])
        lazy = time.perf_counter() - start
        print(
            f"n={n:2d}: DFA up front {up_front:8.3f} s; lazy build and scan to the match "
            f"{lazy * 1e3:.2f} ms ({up_front / lazy:.0f}x); NFA states {len(NFA(pattern).tests)}"
        )


def scan(repeats: int) -> None:
    rng = random.Random(1)
    text = "".join(rng.choice("abcdefgh ijklm.,\nSTOP0123456789") for _ in range(20_000))

    def incremental(pattern: str) -> None:
        scanner = StopRegexScanner([pattern])
        for i in range(0, len(text), 4):
            scanner.feed(text[: i + 4])

    def whole_text(pattern: str) -> None:
        compiled = re.compile(pattern)
        for i in range(0, len(text), 4):
            compiled.search(text[: i + 4])

    for pattern in PATTERNS:
        assert re.search(pattern, text) is None, pattern
        ours = best_seconds(lambda p=pattern: incremental(p), 1, repeats)
        before = best_seconds(lambda p=pattern: whole_text(p), 1, repeats)
        print(
            f"{pattern!r:36}: incremental {ours * 1e3:7.1f} ms, re.search of the whole "
            f"text {before * 1e3:7.1f} ms ({before / ours:.2f}x)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,10,12")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    build([int(n) for n in args.sizes.split(",")])
    scan(args.repeats)


if __name__ == "__main__":
    main()
