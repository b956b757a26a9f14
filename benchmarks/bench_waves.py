"""Traced wave execution against eager thread-per-program execution, on the same engine.

Workloads (issue 5), over 32 inputs each on the built-in `small` model (float32, CPU):
- tree of thought: 3 levels, 3 branches each (27 leaves per input);
- skeleton of thought: a 3-point outline, then every point expanded in a fork.
Reports forward passes and wall time of both modes, and their ratios.

    .venv/bin/python benchmarks/bench_waves.py [--inputs 32]
"""

from __future__ import annotations

import argparse
import time

import lmprog as lp


@lp.function
def tree_of_thought(s, question, depth=3, width=3):
    s += lp.user(f"Solve step by step: {question}")
    s += lp.assistant_begin()

    def expand(state, level):
        if level == depth:
            return
        branches = state.fork(width)
        for i, b in enumerate(branches):
            b += f"\nIdea {level}.{i}:" + lp.gen(f"idea_{level}", max_tokens=8, stop="\n")
            expand(b, level + 1)
        branches.join()

    expand(s, 0)
    s += lp.assistant_end()


@lp.function
def skeleton_of_thought(s, topic):
    s += lp.system("You write short, structured answers.")
    s += lp.user(f"Give 3 key points about {topic}.")
    with s.assistant():
        for i in range(3):
            s += f"{i + 1}." + lp.gen(f"point_{i}", max_tokens=8, stop="\n") + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += lp.user(f"Expand point {i + 1}.")
        f += lp.assistant(lp.gen("detail", max_tokens=16))
    forks.join()


def measure(engine, program, items, eager: bool) -> tuple[float, dict]:
    engine.flush_cache()
    engine.reset_stats()
    start = time.perf_counter()
    states = program.run_batch(items, backend=engine, eager=eager, temperature=0)
    elapsed = time.perf_counter() - start
    errors = [s.error() for s in states if s.error() is not None]
    assert not errors, errors[:1]
    return elapsed, engine.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: built-in small)")
    args = parser.parse_args()

    from lmprog_runtime import default_model_path

    model = args.model or default_model_path("small")
    workloads = {
        "tree of thought (3x3x3)": (
            tree_of_thought,
            [
                {"question": f"How many ways can {i + 2} people share {i + 5} apples?"}
                for i in range(args.inputs)
            ],
        ),
        "skeleton of thought": (
            skeleton_of_thought,
            [{"topic": f"topic number {i}"} for i in range(args.inputs)],
        ),
    }
    print(f"model={model} inputs={args.inputs}")
    print()
    print("| workload | mode | forward passes | time (s) | forwards ratio | time ratio |")
    print("|---|---|---|---|---|---|")
    with lp.Engine(model, max_total_tokens=131072, max_running_requests=256) as engine:
        for name, (program, items) in workloads.items():
            eager_s, eager_stats = measure(engine, program, items, eager=True)
            wave_s, wave_stats = measure(engine, program, items, eager=False)
            ef, wf = int(eager_stats["forward_passes"]), int(wave_stats["forward_passes"])
            print(f"| {name} | eager, thread per program | {ef} | {eager_s:.1f} | 1.00x | 1.00x |")
            print(
                f"| {name} | traced waves | {wf} | {wave_s:.1f} | {wf / ef:.2f}x | {wave_s / eager_s:.2f}x |"
            )


if __name__ == "__main__":
    main()
