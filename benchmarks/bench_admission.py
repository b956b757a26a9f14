"""How many steps admit (`admission_wait_steps`), on the real engine, on a CPU.

A dataset's pattern, as `gpu_check.py`'s `dataset_steps` runs it on a GPU: more requests
than run at once, of spread lengths (16-128 new tokens), so that requests finish and
others are admitted at many steps. On CUDA each step that admits (a prompt's, or a mixed
one) runs eagerly where a decode step replays a graph; on a CPU every step is eager, so
the wall time here says what waiting costs where admitting costs nothing extra, and the
counts say how many eager steps a GPU would run. For each setting: the forwards with
prompts (mixed or not) and in all, the steps that waited, the generate's wall time (best
of `--repeats`), and whether the tokens are the first setting's.

    .venv/bin/python benchmarks/bench_admission.py [--model small] [--requests 256]
        [--batch 64] [--waits 0,4,8,16]
"""

from __future__ import annotations

import argparse
import time

from lmprog_runtime import Engine, default_model_path
from lmprog_runtime.forward_batch import ForwardMode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--waits", default="0,4,8,16")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    n = args.requests
    prompts = [[5 + (i * 7 + j) % 1000 for j in range(8 + i % 5)] for i in range(n)]
    params = [
        {"max_new_tokens": 16 + (i * 37) % 113, "temperature": 0, "ignore_eos": True}
        for i in range(n)
    ]
    print(f"{args.model}: {n} requests of 16-128 new tokens, {args.batch} running, greedy")
    first = None
    for wait in map(int, args.waits.split(",")):
        config = {"max_running_requests": args.batch, "admission_wait_steps": wait}
        with Engine(default_model_path(args.model), **config) as engine:
            counts = {"prompts": 0, "all": 0}
            run = engine.runner.run

            def counted(fb, run=run, counts=counts):
                counts["prompts"] += fb.mode is ForwardMode.EXTEND
                counts["all"] += 1
                return run(fb)

            engine.runner.run = counted
            best = float("inf")
            for _ in range(args.repeats):
                engine.flush_cache()
                engine.reset_stats()
                counts.update(prompts=0, all=0)
                start = time.perf_counter()
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                best = min(best, time.perf_counter() - start)
            tokens = [out["output_ids"] for out in outs]
            first = tokens if first is None else first
            print(
                f"  admission_wait_steps={wait:<3}: {counts['prompts']:4} of {counts['all']:4} "
                f"forwards with prompts, {engine.stats()['admission_waits']:4} steps waited, "
                f"the generate {best:.2f} s, tokens the same as the first: {tokens == first}"
            )


if __name__ == "__main__":
    main()
