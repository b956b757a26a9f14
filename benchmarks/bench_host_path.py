"""The host's share of a decode step against an emulated GPU: what a CPU can say of issue
18's "time outside the GPU" before a GPU runs it.

The model forward is replaced by a sleep of `--device-ms` (the GIL released, as while a
GPU computes) that returns fixed logits, so every other part of a step runs for real:
sampling, appending tokens, stop checks, scheduling, preparing the inputs, and with overlap
scheduling the hand-offs to the forward worker and back. Per step, wall time minus the
emulated device time is the host's critical path: what a GPU would sit idle for. It is
measured for the synchronous loop and the overlapped one, in one run, best of `--repeats`.

    .venv/bin/python benchmarks/bench_host_path.py [--batch 64] [--device-ms 1] [--tokens 128]

(`time.sleep` overshoots by some tens of microseconds; both loops pay it each step.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def host_path(
    batch: int, device_s: float, launch_s: float, tokens: int, repeats: int, overlap: bool
) -> dict:
    from lmprog_runtime import Engine, default_model_path

    with Engine(
        default_model_path("tiny"), max_running_requests=batch, overlap_schedule=overlap
    ) as engine:
        vocab = engine.runner.model_config.vocab_size
        table = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))

        def emulated_forward(fb):
            end = time.perf_counter() + launch_s
            while time.perf_counter() < end:  # launching: Python holding the GIL
                pass
            time.sleep(device_s)  # the device computes; the host is free
            # [logits rows, vocab], one row per `logits_indices` as the real forward
            return table[fb.input_ids[fb.logits_indices] % table.shape[0]]

        engine.runner.run = emulated_forward
        prompts = [[5 + (i * 7 + j) % 1000 for j in range(8)] for i in range(batch)]
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            engine.flush_cache()
            engine.reset_stats()
            start = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - start
            best = min(best, wall / engine.stats()["forward_passes"])
        del engine.runner.run
    return {"step_ms": 1e3 * best, "host_ms": 1e3 * (best - device_s - launch_s)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device-ms", type=float, default=1.0)
    parser.add_argument("--launch-ms", type=float, default=0.1, help="Python work to launch")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        f"batch {args.batch}, emulated device step {args.device_ms:g} ms after "
        f"{args.launch_ms:g} ms of launching, greedy"
    )
    for overlap in (False, True):
        r = host_path(
            args.batch,
            args.device_ms / 1e3,
            args.launch_ms / 1e3,
            args.tokens,
            args.repeats,
            overlap,
        )
        share = r["host_ms"] / r["step_ms"]
        loop = "overlapped " if overlap else "synchronous"
        print(f"{loop}: step {r['step_ms']:.3f} ms, host {r['host_ms']:.3f} ms ({share:.0%})")


if __name__ == "__main__":
    main()
