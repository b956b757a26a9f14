"""Skeleton of thought: outline first, then expand every point in parallel with fork/join.

    .venv/bin/python examples/skeleton_of_thought.py

The parent's prompt is prefilled once; the branches run as one co-scheduled request group.
"""

from __future__ import annotations

import lmprog as lp


@lp.function
def skeleton_of_thought(s, topic, num_points=3):
    s += lp.system("You write short, structured answers.")
    s += lp.user(f"Give {num_points} key points about {topic}.")
    with s.assistant():
        for i in range(num_points):
            s += f"{i + 1}. " + lp.gen(f"point_{i}", max_tokens=8, stop="\n") + "\n"
    forks = s.fork(num_points)
    for i, f in enumerate(forks):
        f += lp.user(f"Expand point {i + 1} in two sentences.")
        f += lp.assistant(lp.gen("detail", max_tokens=24))
    forks.join()
    return s["detail"]


def main() -> None:
    with lp.Engine() as engine:
        lp.set_default_backend(engine)
        state = skeleton_of_thought.run(topic="packing for a hiking trip", temperature=0)
        for i, detail in enumerate(state.ret_value):
            print(f"point {i + 1}: {state[f'point_{i}']!r}\n  detail: {detail!r}")
        stats = engine.stats()
        print(
            f"prefill {int(stats['prefill_tokens'])} tokens, reused {int(stats['cached_tokens'])}"
        )


if __name__ == "__main__":
    main()
