"""Traced wave execution against eager thread-per-program execution, on the same engine.

Workloads (issue 5), over 32 inputs each, greedy, float32:
- tree of thought: 3 levels, 3 branches each (27 leaves per input);
- skeleton of thought: a 3-point outline, then every point expanded in a fork.
Both modes are warmed on another input; rounds alternate which mode goes first and the
cache is flushed before each phase. Reports forward passes and wall time (min / median) of
both modes, and checks that both give every program the same text and variables.

    .venv/bin/python benchmarks/bench_waves.py [--model small] [--inputs 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import harness
from harness import Phase

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


# name -> (program, input builder, variables compared between the modes)
WORKLOADS: dict[str, tuple[Any, Callable[[int], dict[str, str]], tuple[str, ...]]] = {
    "tree of thought (3 levels x 3 branches)": (
        tree_of_thought,
        lambda i: {"question": f"How many ways can {i + 2} people share {i + 5} apples?"},
        ("idea_0", "idea_1", "idea_2"),
    ),
    "skeleton of thought": (
        skeleton_of_thought,
        lambda i: {"topic": f"topic number {i}"},
        ("point_0", "point_1", "point_2", "detail"),
    ),
}


def snapshot(state: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """What a program produced: its text and its variables (gathered lists after joins)."""
    if state.error() is not None:
        raise RuntimeError(f"a program failed: {state.error()}")
    return {"text": state.text(), **{n: state[n] for n in names if n in state}}


def measure(
    engine: Any,
    name: str,
    program: Any,
    items: list[dict],
    warm: dict,
    names: tuple[str, ...],
    rounds: int,
) -> tuple[Phase, Phase]:
    """Both modes on the same engine, warmed on `warm`, an input the timed rounds do not use."""

    def run(eager: bool, batch: list[dict] = items) -> tuple[list[dict[str, Any]], int]:
        states = program.run_batch(batch, backend=engine, eager=eager, temperature=0)
        snaps = [snapshot(s, names) for s in states]
        return snaps, int(engine.stats()["forward_passes"])

    run(True, [warm])
    run(False, [warm])

    def flush() -> None:
        harness.flush(engine)

    eager = Phase(f"{name}: eager", lambda: run(True), before=flush)
    waves = Phase(f"{name}: waves", lambda: run(False), before=flush)
    harness.alternate([eager, waves], rounds)
    return eager, waves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser)
    parser.add_argument("--inputs", type=int, default=32)
    args = parser.parse_args()

    path = harness.resolve_model(args.model)
    engine = lp.Engine(path, dtype=args.dtype, max_total_tokens=131072, max_running_requests=256)
    harness.warm_engine(engine)
    print(f"model={path} inputs={args.inputs}")
    rows, timings, checks = [], {}, {}
    for name, (program, make_input, names) in WORKLOADS.items():
        items = [make_input(i) for i in range(args.inputs)]
        warm = make_input(args.inputs + 1)
        eager, waves = measure(engine, name, program, items, warm, names, args.repeats)
        reference = eager.values[0][0]
        # Every round of both modes must give every program the same text and variables.
        num_equal = sum(
            all(v[0][i] == reference[i] for v in eager.values + waves.values)
            for i in range(len(items))
        )
        match = f"{num_equal}/{len(items)} programs: text and variables equal in both modes"
        # Eager forwards vary with thread timing: the median, and the range when it varies.
        eager_fw = statistics.median_low(v[1] for v in eager.values)
        for mode, phase in (("eager, thread per program", eager), ("traced waves", waves)):
            forwards = [v[1] for v in phase.values]
            fw = statistics.median_low(forwards)
            spread = "" if min(forwards) == max(forwards) else f" ({min(forwards)}-{max(forwards)})"
            rows.append(
                {
                    "workload": name,
                    "mode": mode,
                    "forward passes": f"{fw}{spread}",
                    "time (s, best / median)": f"{phase.best:.2f} / {phase.median:.2f}",
                    "forwards ratio": f"{fw / eager_fw:.2f}x",
                    "time ratio (best / median)": (
                        f"{phase.best / eager.best:.2f}x / {phase.median / eager.median:.2f}x"
                    ),
                    "outputs": "reference" if phase is eager else match,
                }
            )
            timings[phase.name] = {**phase.timing(), "forwards": forwards}
        checks[name] = {"num": len(items), "num_equal": num_equal}
    dtype = harness.param_dtype(engine.runner.model)
    engine.shutdown()
    harness.write_result(
        args,
        "waves",
        {
            "title": "Traced waves vs eager execution",
            "workload": (
                f"{args.inputs} inputs per workload, greedy; the same engine runs both modes "
                "(eager = one executor thread per program state, as SGLang's interpreter "
                f"does); {args.repeats} rounds alternating which mode goes first, both warmed "
                "on another input, the cache flushed before each phase"
            ),
            "columns": list(rows[0]),
            "rows": rows,
            "notes": [],
            "param_dtypes": {"engine": dtype},
            "timings": timings,
            "checks": checks,
        },
    )


if __name__ == "__main__":
    main()
