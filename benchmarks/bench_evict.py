"""Evicting from a full prefix cache: the scheduler's cost when the KV pool is full.

Once a dataset run or a server has filled the KV pool, the tree holds the prompts and
outputs of every finished request, and a step that needs slots evicts (`RadixCache.evict`,
called by the scheduler when an allocation fails). Each round here, as a steady run does,
puts a finished request's 64 tokens in the tree (`insert`) and evicts 64 tokens to make
room for the next: milliseconds per round, best of 5, with `--leaves` requests cached
(the pool's size over the tokens a request leaves: an H200's pool of 1M slots holds
16,384 of them).

    .venv/bin/python benchmarks/bench_evict.py [--leaves 1024,16384]
        [--baseline COMMIT [--rounds 2]]

`--baseline COMMIT` times that commit's runtime too (a git worktree under /tmp), each side
in its own process, alternated `--rounds` times; it reports each side's range.
"""

from __future__ import annotations

import itertools
import random
import sys
import timeit
from pathlib import Path

import harness

OWN = 64  # tokens a finished request leaves in the tree


def measure(root: Path, leaves: int) -> float:
    """Milliseconds per insert-and-evict round (run in a process of its own, `root`'s
    runtime first on the path)."""
    sys.path.insert(0, str(root))
    from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
    from lmprog_runtime.kvcache.radix_cache import RadixCache

    rng = random.Random(0)
    allocator = TokenSlotAllocator(leaves * OWN + 1)
    tree = RadixCache(allocator, 1, "lru")
    ids = itertools.count()

    def finish_one() -> None:  # (a request's own first token: no prefix shared)
        key = [next(ids)] + [rng.randrange(32000) for _ in range(OWN - 1)]
        slots = allocator.alloc(OWN)
        if slots is None:
            tree.evict(OWN)
            slots = allocator.alloc(OWN)
        allocator.free(slots[: tree.insert(key, slots)])

    for _ in range(leaves):  # (full: every later round evicts)
        finish_one()
    return 1e3 * min(timeit.repeat(finish_one, number=50, repeat=5)) / 50


def main() -> None:
    compared = harness.compare_sizes(
        __file__, "leaves", "1024,16384", "cached requests", measure,
        "lmprog_runtime.kvcache.radix_cache",
    )  # fmt: skip
    if compared is None:
        return
    sizes, seen = compared
    print(f"a finished request's {OWN} tokens cached and {OWN} evicted from a full pool")
    print("(ms a round, best of 5, range over the rounds)")
    for n in sizes:
        cells = harness.range_cells(seen, lambda r, n=n: r[str(n)])
        print(f"  {n:6} requests cached: {cells}")


if __name__ == "__main__":
    main()
