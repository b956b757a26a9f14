"""The greedy pick on a CPU: torch's `argmax` against `sampling.argmax_rows` (the indices
of `max`, the same tokens), over batches of next-token logits of a real vocabulary size,
in one run, each the best of `--repeats` rounds.

    .venv/bin/python benchmarks/bench_greedy_pick.py [--vocab 49152] [--rows 1,8,64]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from harness import best_seconds  # noqa: E402

from lmprog_runtime.sampling import argmax_rows  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"vocab {args.vocab}, {torch.get_num_threads()} threads")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
        iters = max(10, 2000 // rows)
        argmax = functools.partial(torch.argmax, logits, dim=-1)
        torch_ms = 1e3 * best_seconds(argmax, iters, args.repeats)
        ours_ms = 1e3 * best_seconds(functools.partial(argmax_rows, logits), iters, args.repeats)
        print(
            f"{rows:4d} rows: argmax {torch_ms:.3f} ms, argmax_rows {ours_ms:.3f} ms "
            f"({torch_ms / ours_ms:.2f}x)"
        )


if __name__ == "__main__":
    main()
