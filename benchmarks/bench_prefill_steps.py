"""How long one engine step of prompts takes, and what smaller steps cost: a batch of
prompts prefilled with `max_prefill_tokens` (the token budget of one forward) at each of
`--budgets`, engines side by side in one process, rounds alternating, the radix cache off.
Aborts, deadlines and Ctrl-C take effect between steps, and the running requests' decode
waits for a step too, so on a CPU the budget bounds how long either waits.

    .venv/bin/python benchmarks/bench_prefill_steps.py [--model instruct] [--budgets 8192,2048,1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmprog_runtime import Engine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="instruct")
    parser.add_argument("--budgets", default="8192,2048,1024")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=330)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    texts = [" ".join(f"w{j}x{i}" for i in range(args.words)) for j in range(args.prompts)]
    engines = {
        b: Engine(
            args.model,
            max_prefill_tokens=b,
            chunked_prefill_size=min(b, 4096),
            disable_radix_cache=True,
        )
        for b in budgets
    }
    try:
        first = engines[budgets[0]]
        tokens = sum(len(first.encode(t)) for t in texts)
        times: dict[int, list[float]] = {b: [] for b in budgets}
        steps = {}
        for _ in range(args.repeats):
            for budget, engine in engines.items():
                engine.reset_stats()
                start = time.perf_counter()
                engine.generate(texts, {"max_new_tokens": 1})
                times[budget].append(time.perf_counter() - start)
                steps[budget] = engine.stats()["forward_passes"]
        base = min(times[budgets[0]])
        print(
            f"{args.model}: {args.prompts} prompts, {tokens} tokens; best / median of {args.repeats}"
        )
        for budget in budgets:
            best, median = min(times[budget]), statistics.median(times[budget])
            print(
                f"max_prefill_tokens {budget:5d}: {steps[budget]} forwards, "
                f"{best:.2f} / {median:.2f} s, {best / steps[budget]:.2f} s a step "
                f"({base / best:.2f}x the first budget's time)"
            )
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
