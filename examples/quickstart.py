"""Quick start: run the in-process engine on the embedded default model.

    make demo        # or: .venv/bin/python examples/quickstart.py

The tiny default model is built locally on first use (random weights, a tokenizer trained
on the shipped corpus), so its text is word salad: the point is the machinery.
"""

from __future__ import annotations

import lmprog as lp


def main() -> None:
    with lp.Engine() as engine:  # the embedded tiny model, on CPU
        prompts = [
            "Question: What is 17 plus 25? Answer:",
            "Dear customer, thank you for writing to us about your parcel",
            "Once upon a time",
        ]
        greedy = engine.generate(prompts, {"max_new_tokens": 16, "temperature": 0})
        for prompt, out in zip(prompts, greedy):
            print(f"{prompt!r} -> {out['text']!r}")

        sampled = engine.generate(
            "The weather today is",
            {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 1, "stop": ["."]},
        )
        print(f"sampled: {sampled['text']!r} ({sampled['meta_info']['finish_reason']})")

        print("streamed: ", end="")
        for chunk in engine.generate("In the kitchen", {"max_new_tokens": 12}, stream=True):
            print(chunk["text"], end="", flush=True)
        print()

        stats = engine.stats()
        print("engine counters:", {k: v for k, v in stats.items() if not k.endswith("seconds")})


if __name__ == "__main__":
    main()
