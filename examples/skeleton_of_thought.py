"""Skeleton of thought: outline first, then expand every point in parallel with fork/join.

    .venv/bin/python examples/skeleton_of_thought.py

The outline is one gen; Python splits it into points (reading a generated value waits
for that gen only). The parent's prompt is prefilled once and the branches run as one
co-scheduled request group. Model: SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import lmprog as lp


@lp.function
def skeleton_of_thought(s, topic, num_points=3):
    s += lp.system("You write short, structured answers.")
    s += lp.user(f"Give {num_points} short tips for {topic}, as a numbered list.")
    s += lp.assistant(lp.gen("outline", max_tokens=80))
    lines = [line.strip() for line in str(s["outline"]).splitlines()]
    points = [line.split(".", 1)[-1].strip() for line in lines if line[:1].isdigit()]
    points = points[:num_points] or [str(s["outline"])]  # a model that wrote no list
    forks = s.fork(len(points))
    for point, f in zip(points, forks):
        f += lp.user(f"Explain this tip in one or two sentences: {point}")
        f += lp.assistant(lp.gen("detail", max_tokens=72, stop="\n"))
    forks.join()  # s["detail"] == [each branch's explanation]
    return points


def main() -> None:
    with lp.Engine("smollm2-135m-instruct") as engine:
        lp.set_default_backend(engine)
        state = skeleton_of_thought.run(topic="staying healthy", temperature=0)
        for point, detail in zip(state.ret_value, state["detail"]):
            print(f"- {point}\n  {detail}")
        stats = engine.stats()
        print(
            f"prefill {int(stats['prefill_tokens'])} tokens, reused {int(stats['cached_tokens'])}"
        )


if __name__ == "__main__":
    main()
