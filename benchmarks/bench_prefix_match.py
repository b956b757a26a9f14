"""Ordering the waiting queue by cached prefix: the scheduler's cost per step with room.

With the `lpm` policy (the default) and up to 128 requests waiting, every step that has
room for a request orders the waiting ones by the length of their cached prefix
(`SchedulePolicy.order`), matching each against the radix tree. A dataset run or a server
keeps up to that many requests waiting, and most steps have room (a request finishes),
so this cost recurs step after step. The workload: the tree holds 64 requests that share
a system prompt of `--shared` tokens and go on with 64 tokens of their own; 128 requests
of the same system prompt and their own 64 tokens wait. Each round times ordering them
again and again (best of 5), as the scheduler does at consecutive steps.

    .venv/bin/python benchmarks/bench_prefix_match.py [--shared 0,512,2048]
        [--baseline COMMIT [--rounds 2]]

`--baseline COMMIT` times that commit's runtime too (a git worktree under /tmp), each side
in its own process, alternated `--rounds` times; it reports each side's range.
"""

from __future__ import annotations

import random
import sys
import timeit
from pathlib import Path

import harness

WAITING, CACHED, OWN = 128, 64, 64


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def measure(root: Path, shared: int) -> float:
    """Milliseconds to order the waiting queue once (run in a process of its own, `root`'s
    runtime first on the path)."""
    sys.path.insert(0, str(root))
    from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
    from lmprog_runtime.kvcache.radix_cache import RadixCache
    from lmprog_runtime.kvcache.req_cache import ReqCache
    from lmprog_runtime.kvcache.req_to_token import ReqToTokenPool
    from lmprog_runtime.request import Req
    from lmprog_runtime.sampling_params import SamplingParams
    from lmprog_runtime.schedule_policy import SchedulePolicy

    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(shared)]
    allocator = TokenSlotAllocator(CACHED * (shared + OWN) + 1024)
    tree = RadixCache(allocator, 1, "lru")
    for _ in range(CACHED):
        key = system + [rng.randrange(1000) for _ in range(OWN)]
        tree.insert(key, allocator.alloc(len(key)))
    params = SamplingParams(max_new_tokens=16)
    kw = {"tokenizer": _Tokenizer(), "eos_token_ids": frozenset(), "context_len": 8192}
    waiting = [
        Req(i, system + [rng.randrange(1000) for _ in range(OWN)], params, **kw)
        for i in range(WAITING)
    ]
    policy = SchedulePolicy("lpm", ReqCache(tree, allocator, ReqToTokenPool(4, 8, "cpu")))
    policy.order(waiting)  # (the first scheduling: the matches start from nothing)
    return 1e3 * min(timeit.repeat(lambda: policy.order(waiting), number=20, repeat=5)) / 20


def main() -> None:
    compared = harness.compare_sizes(
        __file__, "shared", "0,512,2048", "system prompt lengths", measure,
        "lmprog_runtime.schedule_policy",
    )  # fmt: skip
    if compared is None:
        return
    lengths, seen = compared
    print(f"ordering {WAITING} waiting requests by cached prefix (ms, best of 5, range over")
    print(f"the rounds); {CACHED} cached requests; each prompt the system prompt + {OWN} own")
    for n in lengths:
        cells = harness.range_cells(seen, lambda r, n=n: r[str(n)])
        print(f"  system prompt {n:5} tokens: {cells}")


if __name__ == "__main__":
    main()
